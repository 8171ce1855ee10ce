"""The runners: ``python -m experiments.<name>`` (absl flags; ``--help`` lists them).

Quiet by default: JAX's platform probe logs "Unable to initialize backend 'tpu'" at INFO on every CPU run;
that logger is raised to WARNING here unless absl's ``--verbosity`` (``-v``) is given.
"""
import logging as _logging
import sys as _sys

if not any(a.startswith(("--verbosity", "-v", "--v=")) for a in _sys.argv[1:]):
    _logging.getLogger("jax._src.xla_bridge").setLevel(_logging.WARNING)


def with_device_count(xla_flags: str, n: int) -> str:
    """``xla_flags`` with the CPU device count set to ``n`` (replacing a count already there, keeping the
    user's other flags)."""
    kept = [f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept + [f"--xla_force_host_platform_device_count={n}"])


def emulate_cpu_devices(n: int) -> None:
    """Before JAX is imported: emulate ``n`` CPU devices unless the user's XLA_FLAGS already chose a count."""
    import os
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = with_device_count(flags, n)
