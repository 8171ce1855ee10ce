"""Every read of JAX internals in jaxpipe, in one place (jaxpr equation parameters).

jaxpipe reads a jaxpr in one place only: zero-bubble's B/W split (:mod:`jaxpipe.runtime.wsplit`) walks the
pullback of a stage and cuts a ``scan`` over layers in two.  It needs, of a ``scan`` equation, its body and
how its operands divide into constants, carry and scanned inputs.  How JAX spells that changed:

* jax 0.10.x (the pinned set, constraints.txt): ``params["jaxpr"]`` a ``ClosedJaxpr``,
  ``params["num_consts"]`` and ``params["num_carry"]`` ints;
* jax 0.11.x and 0.12.x (tested: 0.12.0.1): no ``num_consts``/``num_carry``; ``params["ft_in"]``, a flat tree
  of three groups ``(consts, carry, xs)`` over the equation's operands, and ``params["jaxpr"]`` a ``Jaxpr``
  that carries its own ``consts`` (``.jaxpr`` is itself).

:func:`scan_layout` reads either; anything else raises :class:`UnknownJaxprLayout`, which the split turns into
"recompute W" (exact, slower) with one warning instead of a crash.

The residual analysis (:func:`jaxpipe.runtime.residuals.residual_mask`) looks inside call equations (``jit``,
``closed_call``, ``checkpoint``: :func:`call_body`) to tell which of their outputs depend on the activation;
an equation it cannot read counts as depending on every input (conservative: a residual stashed that need not
be).

The memory model (:mod:`jaxpipe.tune.memory`) compares its state with XLA's ``argument_size_in_bytes``.
Where JAX hoists closed-over constants into arguments (``jax_use_simplified_jaxpr_constants``, the default
from 0.11: every array constant over ``jax_embedded_constants_max_bytes``, 1 KiB, such as a plan's tick
table at D = 4), those bytes count among the arguments too; :func:`hoisted_constant_bytes` reads them from
the lowering (0 where JAX embeds its constants in the program, as 0.10 does by default).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class UnknownJaxprLayout(Exception):
    """A jaxpr equation whose parameters this module does not know how to read (a JAX newer than tested)."""


class ScanLayout(NamedTuple):
    body: Any  # the body: ``.jaxpr`` (its equations, invars, outvars) and ``.consts``
    num_consts: int
    num_carry: int
    length: int
    reverse: bool


def scan_layout(eqn) -> ScanLayout:
    """The body and operand groups of a ``scan`` equation, on every supported JAX (module docstring)."""
    p = eqn.params
    try:
        body = p["jaxpr"]
        if "num_consts" in p:  # jax <= 0.10
            nc, ncar = int(p["num_consts"]), int(p["num_carry"])
        else:  # jax >= 0.11: a flat tree (consts, carry, xs)
            consts, carry, _ = p["ft_in"].unpack()
            nc, ncar = len(consts), len(carry)
        if not (hasattr(body, "jaxpr") and hasattr(body, "consts")):
            raise TypeError(f"scan body of type {type(body).__name__}")
        return ScanLayout(body, nc, ncar, int(p["length"]), bool(p["reverse"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UnknownJaxprLayout(
            f"a scan equation with parameters {sorted(p)} ({type(e).__name__}: {e})"
        ) from None


#: call-like primitives whose body maps the equation's operands and results one to one (jax 0.10: ``pjit``;
#: 0.11 and later: ``jit``; ``remat``: older spellings of ``checkpoint``)
CALLS = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2")


def call_body(eqn):
    """The body of a call-like equation (its ``invars``/``outvars`` one per operand/result), or None where the
    equation is not one or its parameters are not laid out as expected (callers then stay conservative)."""
    if getattr(eqn.primitive, "name", None) not in CALLS:
        return None
    body = eqn.params.get("jaxpr")
    body = getattr(body, "jaxpr", body)  # a ClosedJaxpr's Jaxpr (a Jaxpr's .jaxpr is itself on 0.11+)
    if not (hasattr(body, "invars") and hasattr(body, "outvars") and hasattr(body, "eqns")):
        return None
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        return None
    return body


def hoisted_constant_bytes(lowered) -> int:
    """Bytes of the constants JAX passes to ``lowered``'s executable as arguments of its own (module
    docstring): each one whole on every device.  0 where the lowering keeps no such list."""
    consts = getattr(getattr(lowered, "_lowering", None), "const_args", None) or ()
    return int(sum(getattr(c, "nbytes", 0) for c in consts))
