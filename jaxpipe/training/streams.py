"""Batch streams a checkpointed run can put back where they were.

A stream resumes in one of two ways: it is an object with ``state_dict()`` / ``load_state_dict()``
(``jaxpipe.data``'s streams have them), or it is given as a function of no arguments that starts the stream
over -- :class:`Replay` then counts what was used, and a resumed run skips as many batches (the same batches, in
the same order, if the stream is seeded).
"""
from __future__ import annotations

import copy
from typing import Callable, Iterator

from jaxpipe.errors import ConfigError


class Replay:
    """A batch stream that resumes by starting over and skipping what was used (``state_dict``: the position)."""

    def __init__(self, start: Callable[[], Iterator]):
        self._start, self._it, self.position = start, start(), 0

    def __iter__(self):
        return self

    def __next__(self):
        self.position += 1
        return next(self._it)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self._it, self.position = self._start(), 0
        for _ in range(int(state["position"])):
            next(self)

    def peek(self):
        return next(self._start())


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
        return Replay(batches)
    raise ConfigError(
        f"the batches are a {type(batches).__name__}, which a resumed run cannot put back where it was: give a "
        f"function of no arguments that starts the stream (e.g. lambda: my_batches(seed)), or an object with "
        f"state_dict() and load_state_dict()")


def stream(batches):
    """``batches`` as an iterator for a run without checkpoints (a function is called to start it)."""
    if is_resumable(batches) or hasattr(batches, "__next__"):
        return batches
    if callable(batches):
        return Replay(batches)
    return iter(batches)
