"""Checkpoint integrity (issue #16): checksums verified on restore, fallback to the newest intact checkpoint,
one writer per directory."""

import glob
import os

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import small_model, SUBPROCESS_XLA_FLAGS

# CI's second leg leaves these out (tests/conftest.py): jaxpipe's own process and file handling
pytestmark = pytest.mark.ci_once


def make():
    model, batch_fn = small_model("mlp", 2)
    return jp.Pipeline(
        model, schedule="1f1b", num_microbatches=2, optimizer=optax.adam(1e-2), mesh=jp.make_mesh(stages=2)
    ), batch_fn


def train_and_save(tmp_path, steps=(2, 4)):
    pipe, batch_fn = make()
    state = pipe.init()
    ck = jp.Checkpointer(tmp_path / "ck", pipe, async_save=False, keep=None)
    saved = {}
    for k in range(1, max(steps) + 1):
        state, _ = pipe.step(state, batch_fn(8, k))
        if k in steps:
            ck.save(k, state, extra={"k": k})
            saved[k] = [np.asarray(a) for a in jax.tree.leaves(state.params)]
    ck.close()
    return saved


def flip_one_bit(step_dir, rng):
    """Flip one random bit of a checkpoint step's state files (a file drawn with probability by its size: a
    uniformly random byte of the checkpoint)."""
    files = sorted(
        f for f in glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True) if os.path.isfile(f)
    )
    sizes = np.array([os.path.getsize(f) for f in files], float)
    f = files[int(rng.choice(len(files), p=sizes / sizes.sum()))]
    data = bytearray(open(f, "rb").read())
    data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(0, 8))
    open(f, "wb").write(bytes(data))
    return f


def test_intact_checkpoint_restores_and_verifies(tmp_path):
    saved = train_and_save(tmp_path)
    pipe, _ = make()
    ck = jp.Checkpointer(tmp_path / "ck", pipe)
    state, extra, step = ck.restore_latest(pipe.init())
    ck.close()
    assert step == 4 and extra == {"k": 4}
    assert all(
        np.array_equal(a, b) for a, b in zip(saved[4], [np.asarray(x) for x in jax.tree.leaves(state.params)])
    )


def test_a_flipped_bit_never_restores_other_values(tmp_path):
    """12 single-bit flips anywhere in the newest checkpoint's files: each restore either reports the damage
    and falls back to step 2, or restores step 4 bit-equal to what was saved (the bit was in bytes no array
    reads); never other values silently.  (Before checksums: 27 of 40 flips restored other finite values.)"""
    import shutil

    saved = train_and_save(tmp_path)
    rng = np.random.default_rng(0)
    pipe, _ = make()
    detected = 0
    for trial in range(12):
        d = tmp_path / f"copy{trial}"
        shutil.copytree(tmp_path / "ck", d)
        flip_one_bit(str(d / "4"), rng)
        said = []
        ck = jp.Checkpointer(d, pipe)
        state, extra, step = ck.restore_latest(pipe.init(), report=said.append)
        ck.close()
        got = [np.asarray(x) for x in jax.tree.leaves(state.params)]
        if step == 2:
            detected += 1
            assert "step 4" in said[0] and "falling back to step 2" in said[0] and extra == {"k": 2}
            assert all(np.array_equal(a, b) for a, b in zip(saved[2], got))
        else:
            assert step == 4 and not said and all(np.array_equal(a, b) for a, b in zip(saved[4], got))
    assert detected >= 3


def test_missing_files_fall_back_too(tmp_path):
    train_and_save(tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "ck" / "4" / "meta")
    pipe, _ = make()
    said = []
    ck = jp.Checkpointer(tmp_path / "ck", pipe)
    _, _, step = ck.restore_latest(pipe.init(), report=said.append)
    ck.close()
    assert step == 2 and "step 4" in said[0]


def test_one_writer_per_directory(tmp_path):
    pipe, _ = make()
    first = jp.Checkpointer(tmp_path / "ck", pipe, writer=True)
    with pytest.raises(jp.ConfigError, match=f"in use by process {os.getpid()}"):
        jp.Checkpointer(tmp_path / "ck", pipe, writer=True)
    reader = jp.Checkpointer(tmp_path / "ck", pipe)  # restoring needs no lock
    reader.close()
    first.close()
    jp.Checkpointer(tmp_path / "ck", pipe, writer=True).close()  # released on close


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, capsys):
    import json
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    os.makedirs(tmp_path / "ck")
    json.dump(
        {"host": socket.gethostname(), "pid": dead.pid, "since": "earlier"},
        open(tmp_path / "ck" / ".jaxpipe.lock", "w"),
    )
    pipe, _ = make()
    jp.Checkpointer(tmp_path / "ck", pipe, writer=True).close()
    assert "taking over" in capsys.readouterr().out


def test_read_only_directory_is_refused_before_training(tmp_path):
    """Also as root (CI): the immutable attribute stops root's writes, and a path under a regular file."""
    from helpers import read_only

    d = tmp_path / "ro"
    os.makedirs(d)
    pipe, _ = make()
    with read_only(d):
        with pytest.raises(jp.ConfigError, match="not writable"):
            jp.Checkpointer(d, pipe)
        with pytest.raises(jp.ConfigError, match="cannot be created"):
            jp.Checkpointer(d / "sub", pipe)
    (tmp_path / "afile").write_text("")
    with pytest.raises(jp.ConfigError, match="a part of the path is a file"):
        jp.Checkpointer(tmp_path / "afile" / "ck", pipe)


def test_a_directory_made_read_only_mid_run_ends_in_one_clear_error(tmp_path):
    """#31: the checkpoint directory becomes unwritable after step 4's checkpoint (as root too): the run ends
    with status 1 and one line naming the step that failed and the intact one (it used to stall ~300 s and
    print 364 lines of Orbax tracebacks). Event-driven: the flip waits for step 4's folder, bounded."""
    import subprocess
    import sys
    import time
    from helpers import read_only

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    ck = tmp_path / "ck"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--model=mlp",
            "--steps=200",
            "--batch=32",
            "--microbatches=4",
            "--stages=2",
            "--eval_every=0",
            "--progress=false",
            f"--checkpoint_dir={ck}",
            "--checkpoint_every=4",
            "--throttle_s=0.2",
            f"--out_dir={tmp_path}/run",
        ],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while not (ck / "4").is_dir() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert (ck / "4").is_dir(), "step 4's checkpoint never appeared"
    with read_only(ck):
        _, err = p.communicate(timeout=240)
    assert p.returncode == 1, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[:3000]
    assert "could not be written" in lines[0] and "newest finished checkpoint holds step 4" in lines[0], (
        lines[0]
    )
    assert ("Operation not permitted" if os.geteuid() == 0 else "Permission denied") in lines[0], lines[0]


def test_restore_with_another_optimizer_or_batch_size_names_the_cause(tmp_path):
    model, batch_fn = small_model("mlp", 2)
    mk = lambda opt: jp.Pipeline(
        model, schedule="pipeoptim", num_microbatches=2, optimizer=opt, mesh=jp.make_mesh(stages=2)
    )
    p = mk(optax.adam(1e-2))
    st, _ = p.step(p.init(), batch_fn(8))
    ck = jp.Checkpointer(tmp_path / "ck", p, async_save=False)
    ck.save(1, st)
    ck.close()
    q = mk(optax.sgd(0.1))
    with pytest.raises(jp.ConfigError, match="another optimizer"):
        jp.Checkpointer(tmp_path / "ck", q).restore(q.prepare(q.init(), batch_fn(8)))
    r = mk(optax.adam(1e-2))
    with pytest.raises(jp.ConfigError, match="batch size"):
        jp.Checkpointer(tmp_path / "ck", r).restore(r.prepare(r.init(), batch_fn(16)))


def _meta_file(step_dir):
    files = [
        f
        for f in glob.glob(os.path.join(step_dir, "meta", "**", "*"), recursive=True)
        if os.path.isfile(f) and not f.endswith(".txt")
    ]
    assert len(files) == 1, files
    return files[0]


def test_metadata_is_checksummed_and_covered_by_the_fallback(tmp_path):
    """A flipped digit in the metadata (the step, the data position) must not resume "at step 6" with step 4's
    weights: the metadata's own SHA-256 is checked first, and the newest intact checkpoint is used instead."""
    import json

    train_and_save(tmp_path)
    path = _meta_file(tmp_path / "ck" / "4")
    meta = json.load(open(path))
    assert len(meta["meta_sha256"]) == 64
    meta["step"] = 6  # one digit changed, the digest left as written
    json.dump(meta, open(path, "w"))
    pipe, _ = make()
    said = []
    ck = jp.Checkpointer(tmp_path / "ck", pipe)
    _, extra, step = ck.restore_latest(pipe.init(), report=said.append)
    ck.close()
    assert step == 2 and extra == {"k": 2}
    assert "step 4" in said[0] and "its metadata" in said[0] and "falling back to step 2" in said[0]
    # the same flip in the data position
    meta["step"], meta["extra"]["k"] = 4, 5
    json.dump(meta, open(path, "w"))
    with pytest.raises(jp.checkpoint.CorruptCheckpoint, match="metadata"):
        jp.Checkpointer(tmp_path / "ck", pipe).restore(pipe.init(), 4)


def test_saving_a_step_again_is_refused_and_the_first_stays(tmp_path):
    pipe, batch_fn = make()
    state, _ = pipe.step(pipe.init(), batch_fn(8, 1))
    first = jax.tree.map(np.asarray, state)
    ck = jp.Checkpointer(tmp_path / "ck", pipe, async_save=False)
    assert ck.save(1, state) is True
    state, _ = pipe.step(state, batch_fn(8, 2))
    with pytest.raises(jp.ConfigError, match="step 1 is already saved.*never overwritten"):
        ck.save(1, state)
    restored, _, step = ck.restore(pipe.init(), 1)
    assert step == 1 and all(
        np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(restored))
    )
    ck.close()


def test_a_lock_path_that_is_a_directory_is_a_clear_error(tmp_path):
    pipe, _ = make()
    os.makedirs(tmp_path / "ck" / ".jaxpipe.lock")
    with pytest.raises(jp.ConfigError, match=r"\.jaxpipe\.lock is a directory"):
        jp.Checkpointer(tmp_path / "ck", pipe, writer=True)


LOCKER = r"""
import sys, time
sys.path.insert(0, {root!r})
from jaxpipe.checkpoint import _DirectoryLock
from jaxpipe.errors import ConfigError
start = float(sys.argv[2])
while time.time() < start:
    pass
out, sys.stdout = sys.stdout, sys.stderr       # the takeover's own message goes to stderr here
try:
    lock = _DirectoryLock(sys.argv[1])
    print("HELD", file=out, flush=True)
    sys.stdin.readline()                  # hold it until the test has counted
except ConfigError as e:
    print("REFUSED", str(e)[:200], file=out, flush=True)
"""


def test_racing_takeovers_of_a_dead_owners_lock_give_it_to_one(tmp_path):
    """Four processes take over a dead owner's lock at the same instant, five times: exactly one holds it each
    time (before: unlink-and-create let two both believe they held it in 51 of 300 trials)."""
    import json
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for trial in range(5):
        d = tmp_path / f"ck{trial}"
        os.makedirs(d)
        json.dump({"host": "here", "pid": 999999, "since": "earlier"}, open(d / ".jaxpipe.lock", "w"))
        start = time.time() + 1.0
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", LOCKER.format(root=root), str(d), str(start)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for _ in range(4)
        ]
        first = [p.stdout.readline() for p in procs]  # each says HELD or REFUSED, then waits
        for p in procs:
            p.communicate("\n", timeout=30)  # the holder lets go; the others have ended
        assert sum(l.startswith("HELD") for l in first) == 1, first
        assert all("is in use by" in l for l in first if l.startswith("REFUSED")), first


def test_a_write_that_fails_is_one_clear_error(tmp_path):
    """Disk full / a file-size limit: Orbax's asynchronous write failed in its threads and the run ended in
    hundreds of lines of tracebacks; the caller now gets one CheckpointWriteError naming the step, the reason
    and the newest finished checkpoint (experiments.train prints it as one line and exits 1)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    # no compilation cache: under the file-size limit its entries are written truncated, and every later run
    # that shares the cache then warns "Error reading persistent compilation cache entry"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    # the shell sets the limit (100 KiB per file) and becomes the run: no fork of this JAX process
    p = subprocess.run(
        [
            "bash",
            "-c",
            'ulimit -f 100 && exec "$@"',
            "bash",
            sys.executable,
            "-m",
            "experiments.train",
            "--model=mlp",
            "--steps=12",
            "--batch=32",
            "--microbatches=4",
            "--stages=2",
            "--eval_every=0",
            "--progress=false",
            f"--checkpoint_dir={tmp_path}/ck",
            "--checkpoint_every=4",
            f"--out_dir={tmp_path}/run",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("jaxpipe: checkpoint step 4 could not be written to") and "File too large" in last
    ), last
    assert "The newest finished checkpoint holds step none" in last
    # nothing else: neither Orbax's logged tracebacks nor tensorstore's "Event loop is closed" callbacks
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr[:3000]


def test_closing_on_an_error_path_is_bounded_and_frees_the_lock(tmp_path):
    """``close_within``: a write that never finishes (a stalled file system) is abandoned after the bound,
    named, and the directory's lock is released all the same -- the error that ended the run goes on."""
    import threading

    ck = jp.Checkpointer(str(tmp_path / "ck"), None, writer=True)
    assert os.path.exists(tmp_path / "ck" / ".jaxpipe.lock")
    stall = threading.Event()
    ck.manager.wait_until_finished = lambda: stall.wait(30)
    ck._pending = 7
    note = ck.close_within(0.2)
    assert note is not None and "checkpoint step 7" in note and "did not finish within 0.2 s" in note, note
    assert not os.path.exists(tmp_path / "ck" / ".jaxpipe.lock")
    stall.set()
    again = jp.Checkpointer(str(tmp_path / "ck"), None, writer=True)  # the directory is free
    assert again.close_within(5.0) is None
