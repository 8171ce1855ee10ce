"""``jaxpipe.host_memory.keep_freed_memory``: after it, a large buffer allocated and freed step after step is
reused instead of mapped and page-faulted again (issue #30: Chimera's one-core cost on XLA CPU was mostly
that), on the main thread and on a worker thread (XLA allocates from its own threads); elsewhere than glibc it
changes nothing and says why."""

import json
import os
import platform
import subprocess
import sys

import pytest

from jaxpipe import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES_48MIB = (48 << 20) // 4096

PROBE = """
import ctypes, json, resource, sys, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def faults(rounds=5):
    '''Page faults of `rounds` steps that each allocate, fill and free 48 MiB (above glibc's largest dynamic
    mmap threshold, 32 MiB) with malloc, as XLA CPU does, on this thread.'''
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        a = libc.malloc(48 << 20)
        ctypes.memset(a, 1, 48 << 20)
        libc.free(a)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0

def on_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start(); t.join()
    return out[0]

before = [faults(), on_thread(faults)]
from jaxpipe import host_memory
kept = host_memory.keep_freed_memory()
faults(1); on_thread(lambda: faults(1))     # the first step after maps its buffer once
after = [faults(), on_thread(faults)]
print(json.dumps({"before": before, "kept": kept, "after": after, "again": host_memory.keep_freed_memory(),
                  "line": host_memory.describe()}))
"""


def run_probe(env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(PYTHONPATH=ROOT, **(env_extra or {}))
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="the probe counts glibc's page faults",
)
def test_kept_memory_is_reused_without_page_faults():
    r = run_probe()
    # glibc's defaults: every 48 MiB step maps and faults its pages again (5 steps, main thread and a thread)
    assert all(b > 0.9 * 5 * PAGES_48MIB for b in r["before"]), r
    assert r["kept"] is True and r["again"] is True
    assert all(a < 0.02 * 5 * PAGES_48MIB for a in r["after"]), r
    assert r["line"].startswith("glibc keeps freed memory")


def test_describe_names_the_default_and_the_environment(monkeypatch):
    monkeypatch.setitem(host_memory._state, "kept", False)
    monkeypatch.setitem(host_memory._state, "why_not", "")
    for k in host_memory.KEEP_FREED_ENV:
        monkeypatch.delenv(k, raising=False)
    assert not host_memory.keeps_freed_memory()
    assert "default allocator" in host_memory.describe()
    for k, v in host_memory.KEEP_FREED_ENV.items():
        monkeypatch.setenv(k, v)
    assert host_memory.keeps_freed_memory() and "keeps freed memory" in host_memory.describe()


def test_not_glibc_changes_nothing_and_says_why(monkeypatch):
    monkeypatch.setitem(host_memory._state, "kept", False)
    monkeypatch.setitem(host_memory._state, "why_not", "")
    for k in host_memory.KEEP_FREED_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert host_memory.keep_freed_memory() is False
    assert "musl" in host_memory.describe() and "left as it is" in host_memory.describe()
    monkeypatch.setattr(host_memory.sys, "platform", "darwin")
    assert host_memory.keep_freed_memory() is False and "not Linux" in host_memory.describe()


BUILD = """
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax.numpy as jnp
import jaxpipe as jp
model = jp.PipelineModel(stage_fn=lambda w, h: jnp.tanh(h @ w), stage_params=jnp.ones((2, 4, 4)),
                         post_loss=lambda _, h, b: jnp.mean(h ** 2))
before = jp.host_memory.keeps_freed_memory()
jp.Pipeline(model, schedule="1f1b", num_microbatches=2, mesh=jp.make_mesh(stages=2))
print(json.dumps([before, jp.host_memory.keeps_freed_memory(), jp.host_memory.describe()]))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="keeping freed memory needs glibc",
)
@pytest.mark.parametrize("opt_out", ["", "0"])
def test_a_pipeline_on_cpu_keeps_freed_memory_unless_told_not_to(opt_out):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != host_memory.OPT_OUT}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    if opt_out:
        env[host_memory.OPT_OUT] = opt_out
    p = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    before, after, line = json.loads(p.stdout.strip().splitlines()[-1])
    assert before is False
    assert after is (not opt_out), line
    assert ("keeps freed memory" in line) is (not opt_out)
