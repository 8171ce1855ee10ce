"""The job's stop as the processes agree on it, without starting processes: the per-step agreement
(``Trainer._agreed_stop``) with the peers' flags given by hand, and ``Stop``'s first cause kept over later
requests.  A stop seen by one process of several must stop them all, and say whose it was."""

import types

import numpy as np
import pytest

from jaxpipe.training import loop
from jaxpipe.training.stopping import Stop


def _agree(monkeypatch, told, this=0, own_reason=None):
    """``_agreed_stop`` in process ``this`` of ``len(told)``, the allgather answering ``told`` (1: that
    process was told to stop)."""
    import jax
    from jax.experimental import multihost_utils

    stop = Stop(1.0)
    if own_reason:
        stop.request(own_reason)
    monkeypatch.setattr(jax, "process_count", lambda: len(told))
    monkeypatch.setattr(
        multihost_utils,
        "process_allgather",
        lambda x: (
            np.asarray(told, np.int32)
            if int(x) == told[this]
            else pytest.fail(f"process {this} sent {int(x)}, its flag is {told[this]}")
        ),
    )
    trainer = types.SimpleNamespace(stop=stop, opts=types.SimpleNamespace(overlap_steps=False), _vote=None)
    return loop.Trainer._agreed_stop(trainer), stop


def test_a_stop_seen_by_one_process_of_two_stops_both(monkeypatch):
    """Process 0 got no signal, process 1 did: process 0 stops after the same step, naming process 1."""
    agreed, stop = _agree(monkeypatch, [0, 1], this=0)
    assert agreed and stop.reason == "a stop signal to process 1"


def test_the_process_that_was_told_keeps_its_own_reason(monkeypatch):
    agreed, stop = _agree(monkeypatch, [0, 1, 0], this=1, own_reason="SIGTERM")
    assert agreed and stop.reason == "SIGTERM"


def test_no_process_told_goes_on(monkeypatch):
    agreed, stop = _agree(monkeypatch, [0, 0], this=1)
    assert not agreed and stop.reason is None and not stop


def test_a_second_request_keeps_the_first_cause():
    """SIGTERM, then a peer's stop or a hook's: the stop is still reported as the SIGTERM."""
    stop = Stop(1.0, write=lambda _: None)
    stop.on_signal(15)  # SIGTERM, as its handler gets it
    stop.request("a stop signal to process 1")
    stop.request("stop_at_step=3")
    assert stop.reason == "SIGTERM" and stop.signals == ["SIGTERM"]
    first = Stop(1.0, write=lambda _: None)
    first.request("stop_at_step=3")
    first.request("a stop signal to process 0")
    assert first.reason == "stop_at_step=3"


def test_overlapped_steps_read_the_peers_flags_one_vote_late(monkeypatch):
    """With ``overlap_steps`` each step's gather is read at the next step (it would otherwise wait for the
    step in flight): process 1's flag, cast at the second step, stops process 0 at the third -- and every
    process reads the same votes at the same step."""
    import jax

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    peer_flags = iter([0, 1, 1])
    sent = []

    def gather(flag):
        sent.append(flag)
        return np.array([int(flag), next(peer_flags)], np.int32)

    trainer = types.SimpleNamespace(
        stop=Stop(1.0), opts=types.SimpleNamespace(overlap_steps=True), _vote=loop.LaggedVote(gather)
    )
    agreed = [loop.Trainer._agreed_stop(trainer) for _ in range(3)]
    assert agreed == [False, False, True] and sent == [False, False, False]
    assert trainer.stop.reason == "a stop signal to process 1"
