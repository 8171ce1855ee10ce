"""Batch streams a checkpointed run can put back where they were.

A stream resumes in one of two ways: it is an object with ``state_dict()`` / ``load_state_dict()``
(``jaxpipe.data``'s streams have them), or it is given as a function of no arguments that starts the stream
over -- :class:`Replay` then counts what was used, and a resumed run skips as many batches (the same batches,
in the same order, if the stream is seeded).
"""

from __future__ import annotations

import copy
from typing import Callable, Iterator

from jaxpipe.errors import ConfigError


class Replay:
    """A batch stream that resumes by starting over and skipping what was used (``state_dict``: the position).

    ``start`` must begin a new stream at each call: one that hands back the same iterator each time (``lambda:
    it``) cannot start over -- a resume would skip from wherever that iterator is, and each restart (the peek
    at the batch's shapes included) loses batches.  That is refused at the first restart, and up front where
    ``check_restart`` (a checkpointed run: it will restart when resumed)."""

    def __init__(self, start: Callable[[], Iterator], check_restart: bool = False):
        self._start, self._it, self.position, self._spare = start, start(), 0, None
        if check_restart:
            self._spare = self._restart()

    def _restart(self) -> Iterator:
        """A new stream from ``start``, or a ConfigError where it is the one already running."""
        it = self._spare if self._spare is not None else self._start()
        self._spare = None
        if it is self._it:
            name = getattr(self._start, "__name__", type(self._start).__name__)
            raise ConfigError(
                f"the batches function {name} returns the same iterator each time it is called "
                f"({type(it).__name__} object): a checkpointed run starts the stream over to resume it, and "
                "this "
                "one would go on from wherever it is (a batch lost at every restart). Make the function "
                "start a "
                "new stream, e.g. lambda: iter(my_dataset) or a generator function (def batches(): ... "
                "yield b), "
                f"or give an object with state_dict() and load_state_dict()"
            )
        return it

    def __iter__(self):
        return self

    def __next__(self):
        self.position += 1
        return next(self._it)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self._it, self.position = self._restart(), 0
        for _ in range(int(state["position"])):
            next(self)

    def peek(self):
        return next(self._restart())


def is_resumable(batches) -> bool:
    return hasattr(batches, "state_dict") and hasattr(batches, "load_state_dict")


def peek(batches):
    """A batch of the stream (for its shapes), leaving the stream where it is."""
    if hasattr(batches, "peek"):
        return batches.peek()
    return next(copy.deepcopy(batches))


def resumable(batches):
    """``batches`` as a stream a checkpointed run can put back (module docstring), or a ConfigError that says
    what to give instead."""
    if is_resumable(batches):
        return batches
    if callable(batches):
        return Replay(batches, check_restart=True)
    raise ConfigError(
        f"the batches are a {type(batches).__name__}, which a resumed run cannot put back where it was: "
        "give a "
        f"function of no arguments that starts the stream (e.g. lambda: my_batches(seed)), or an object with "
        f"state_dict() and load_state_dict()"
    )


def stream(batches):
    """``batches`` as an iterator for a run without checkpoints (a function is called to start it)."""
    if is_resumable(batches) or hasattr(batches, "__next__"):
        return batches
    if callable(batches):
        return Replay(batches)
    return iter(batches)
