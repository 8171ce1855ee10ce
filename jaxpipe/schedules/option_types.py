"""The types and ranges of the methods' options (``Pipeline(options=...)``), checked before anything is built:
``options={"apc": "false"}`` must not switch APC on (``bool("false")`` is True), ``max_deferred_w=2.7`` must
not become 2.  Pure Python.  Each :class:`Opt` says what a value must be and gives an example for the
error."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional, Tuple

from .ir import ScheduleError


@dataclasses.dataclass(frozen=True)
class Opt:
    """``kind``: ``"bool"``, ``"int"``, ``"number"`` or ``"choice"``; ``minimum`` (int/number, inclusive),
    ``above`` (number: strictly greater), ``maximum`` (number, inclusive); ``choices`` (choice); ``none_ok``:
    None is accepted (the method picks); ``literals``: other accepted values (``"auto"``)."""

    kind: str
    minimum: Optional[float] = None
    above: Optional[float] = None
    maximum: Optional[float] = None
    choices: Tuple[Any, ...] = ()
    none_ok: bool = False
    literals: Tuple[Any, ...] = ()
    meaning: str = ""  # what the option does, said in the error

    def accepts(self, v) -> bool:
        if v is None and self.none_ok or (isinstance(v, str) and v in self.literals):
            return True
        if self.kind == "bool":
            return isinstance(v, bool) or (type(v).__name__ == "bool_")  # numpy.bool_
        if self.kind == "choice":
            return isinstance(v, str) and v in self.choices
        integral = isinstance(v, numbers.Integral) and not isinstance(v, bool)
        if self.kind == "int" and not integral:
            return False
        if self.kind == "number" and not (isinstance(v, numbers.Real) and not isinstance(v, bool)):
            return False
        return (
            (self.minimum is None or v >= self.minimum)
            and (self.above is None or v > self.above)
            and (self.maximum is None or v <= self.maximum)
        )

    def wants(self) -> str:
        """What a value must be, in words."""
        if self.kind == "bool":
            out = "True or False (a Python bool)"
        elif self.kind == "choice":
            out = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            out = "an integer" if self.kind == "int" else "a number"
            bounds = [
                f">= {self.minimum:g}" if self.minimum is not None else "",
                f"> {self.above:g}" if self.above is not None else "",
                f"<= {self.maximum:g}" if self.maximum is not None else "",
            ]
            out += "".join(" " + b for b in bounds if b)
        extra = [repr(x) for x in self.literals] + (["None (the method's default)"] if self.none_ok else [])
        return out + ("" if not extra else ", or " + " or ".join(extra))


BOOL = Opt("bool")


def check_options(method: str, values: dict, types: dict) -> None:
    """ScheduleError naming the first option of ``values`` whose value ``types`` does not accept."""
    for key, value in values.items():
        spec = types.get(key)
        if spec is not None and not spec.accepts(value):
            raise ScheduleError(
                f"{method}: options[{key!r}]={value!r} ({type(value).__name__}); it must be "
                f"{spec.wants()}" + (f" ({spec.meaning})" if spec.meaning else "")
            )
