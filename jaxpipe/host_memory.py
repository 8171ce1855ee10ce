"""Host memory on XLA CPU: keep freed buffers for the next step instead of handing them back to the OS.

XLA CPU allocates an execution's large buffers (its temp allocation, outputs, the results of collectives)
afresh on every call, with ``malloc``. With glibc's defaults a buffer above the mmap threshold (dynamic, at
most 32 MiB) is mapped anew and unmapped when freed, and the top of a heap is trimmed, so every step
page-faults its footprint again: the kernel zeroes every page the step touches. That cost is in proportion to
what a step allocates, not to what it computes, and accelerator allocators (which pool memory) do not have it.
Measured on the executor's benchmark (one core, D = 4, M = 8; BUILD_NOTES "The CPU backend"):
Chimera's step, which allocates about 14 MiB per device more than 1F1B's (a fetched replica and its gradient
sum), page-faulted ~110 MiB more per step and spent ~60 ms of a ~450 ms step in the kernel for it.

:func:`keep_freed_memory` sets glibc's ``mallopt`` so that freed memory stays in the process (no per-step
mapping, no trimming): the next step reuses it without faults. It is process-wide and permanent (the
process's resident memory stays at its peak, as it does with an accelerator's allocator). ``Pipeline`` and
``CyclicDataParallel`` call it when built on a mesh of CPU devices (:func:`keep_freed_memory_for`), unless the
environment says ``JAXPIPE_KEEP_FREED_MEMORY=0``; a script may call it itself at any time. On anything but
glibc (macOS, musl) it changes nothing and says so.

**Threads that allocated before it keep their own arenas** (``M_ARENA_MAX`` binds only threads that have not
allocated yet): XLA's worker threads, started with the CPU backend before any ``Pipeline``, still map and trim
their heaps. Measured (the two-process testbed's model, D = 2 emulated on one core, Chimera M = 4): 34,400
page faults a step and 1.41x 1F1B's step when kept from the first ``Pipeline``; 1.06x and no faults with
:data:`KEEP_FREED_ENV` in the environment from the start. It is not set at import: one arena for every thread
also serialises XLA's compiler threads on malloc's lock -- the guide's ``configure`` search took 118 s cold
with ``MALLOC_ARENA_MAX=1`` from the start against 82 s without. A long CPU run (a benchmark of many steps)
should start with :data:`KEEP_FREED_ENV`; a compile-heavy one (tests, a search) should not.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

#: glibc's ``mallopt`` parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8
#: the values :func:`keep_freed_memory` sets: no mapping below 1 GiB, no trimming below 1 GiB, and 64 MiB kept
#: at the top of each heap (without it, glibc's per-thread heaps -- where XLA's worker threads allocate -- are
#: still released when they empty; measured: 10k faults per step left at top pad 0, none at 64 MiB), and one
#: arena: a thread's own arena grows in heaps of at most 64 MiB, so a larger buffer allocated on an XLA worker
#: thread is mapped and unmapped on every call whatever the thresholds say (Chimera, D = 2, one core, 8 x
#: 1024² MLP: 32,898 faults and 60 ms in the kernel per step, 1.43x the plain step; one arena: none, 1.16x)
KEEP_FREED = {M_MMAP_THRESHOLD: 1 << 30, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20, M_ARENA_MAX: 1}
#: the same, as the environment variables glibc reads at process start (for a child process)
KEEP_FREED_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_TOP_PAD_": str(64 << 20),
    "MALLOC_ARENA_MAX": "1",
}

_state = {"kept": False, "why_not": ""}


def _glibc():
    """glibc's ``mallopt`` as a ctypes function, or ``(None, why not)``."""
    if not sys.platform.startswith("linux"):
        return None, f"not Linux ({sys.platform}): the host allocator is left as it is"
    lib, _ = platform.libc_ver()
    if lib != "glibc":
        return None, f"the C library is {lib or 'not glibc'}: the host allocator is left as it is"
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError as e:  # pragma: no cover - glibc without the usual soname
        return None, f"libc.so.6 could not be loaded ({e}): the host allocator is left as it is"
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt, ""


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory in this process (see the module docstring); idempotent.

    Returns True where it took effect (Linux with glibc), False elsewhere; :func:`describe` says which and
    why. Call it any time -- before or after JAX starts; buffers freed from then on are kept.
    """
    if _state["kept"]:
        return True
    mallopt, why = _glibc()
    if mallopt is None:
        _state["why_not"] = why
        return False
    refused = [k for k, v in KEEP_FREED.items() if mallopt(k, v) != 1]
    if refused:  # pragma: no cover - every glibc since 2.x takes these values
        _state["why_not"] = (
            f"glibc refused mallopt parameter(s) {refused}: the host allocator is left as it is"
        )
        return False
    _state["kept"] = True
    return True


#: the environment variable that turns off what :func:`keep_freed_memory_for` does ("0": glibc's defaults
#: stay)
OPT_OUT = "JAXPIPE_KEEP_FREED_MEMORY"


def keep_freed_memory_for(mesh) -> bool:
    """What ``Pipeline`` and ``CyclicDataParallel`` do when built: on a mesh with CPU devices,
    :func:`keep_freed_memory`, unless ``JAXPIPE_KEEP_FREED_MEMORY=0``; returns whether memory is kept now."""
    opted_out = os.environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off")
    if opted_out or not any(d.platform == "cpu" for d in mesh.devices.flat):
        return keeps_freed_memory()
    return keep_freed_memory()


def choose(keep: bool) -> bool:
    """A runner's ``--keep_freed_memory`` flag: True keeps freed memory now; False sets
    ``JAXPIPE_KEEP_FREED_MEMORY=0`` so that no ``Pipeline`` built later turns it on (glibc's defaults stay,
    unless they were already changed).  Returns whether memory is kept."""
    if keep:
        return keep_freed_memory()
    os.environ[OPT_OUT] = "0"
    return keeps_freed_memory()


def keeps_freed_memory() -> bool:
    """Whether this process keeps freed memory: :func:`keep_freed_memory` was called, or glibc was started
    with :data:`KEEP_FREED_ENV` in the environment."""
    return _state["kept"] or all(os.environ.get(k) == v for k, v in KEEP_FREED_ENV.items())


def describe() -> str:
    """One line for a benchmark's header: which allocator behaviour its figures are for."""
    if keeps_freed_memory():
        return "glibc keeps freed memory (jaxpipe.host_memory.keep_freed_memory)"
    if _state["why_not"]:
        return _state["why_not"]
    return "glibc's default allocator (each step maps and page-faults its large buffers afresh)"
