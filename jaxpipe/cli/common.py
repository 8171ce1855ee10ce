"""What every command of ``jaxpipe`` (and every ``python -m experiments.<runner>``) shares: ``--help`` that
lists the command's own flags (those it imports from another module included) and exits 0 -- absl's exits 1,
and lists only the flags the ``__main__`` module itself defines; JAX's persistent compilation cache, on by
default (``--compilation_cache_dir``): a run compiles what an earlier run with the same program, flags and
versions compiled once (the first step of a 10-block model took 100-250 s on a busy 2-core machine); and a
quiet start: JAX's platform probe logs "Unable to initialize backend 'tpu'" at INFO on every CPU run, raised
to WARNING here unless absl's ``--verbosity`` (``-v``) is given."""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags

if not any(a.startswith(("--verbosity", "-v", "--v=")) for a in sys.argv[1:]):
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

#: the modules whose flags a command's ``--help`` lists beside its own
FLAG_MODULES = ("jaxpipe.cli", "experiments")

HELP = ("--help", "-h", "-?", "--helpshort")

#: where the runners keep compiled programs unless told otherwise: $JAX_COMPILATION_CACHE_DIR, else a user
#: cache
DEFAULT_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "jaxpipe", "xla"
)
flags.DEFINE_string(
    "compilation_cache_dir",
    DEFAULT_CACHE,
    "JAX's persistent compilation cache: compiled programs are kept here and reused by later runs "
    "('' turns it off; default $JAX_COMPILATION_CACHE_DIR, else ~/.cache/jaxpipe/xla)",
)


def run(main, doc: str | None = None) -> None:
    """``absl.app.run(main)``, after answering ``--help`` (before a ``--``: what follows is a worker's) with
    ``doc`` (default: the ``__main__`` module's docstring) and the command's flags."""
    argv = sys.argv[1:]
    own = argv[: argv.index("--")] if "--" in argv else argv
    if any(a in HELP for a in own):
        print(usage(doc))
        sys.exit(0)

    def cached(argv):
        use_compilation_cache(flags.FLAGS.compilation_cache_dir)
        return main(argv)

    app.run(cached)


def use_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache in ``path`` ('' or None: off) -- the one line an API user writes is
    ``jax.config.update("jax_compilation_cache_dir", path)``."""
    if path:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:  # a file there, or a path under a file, or no permission
            raise app.UsageError(
                f"--compilation_cache_dir={path}: cannot be a directory ({e.strerror}); give a "
                f"directory path, or --compilation_cache_dir='' to keep no compiled programs"
            ) from None
        os.environ["JAX_COMPILATION_CACHE_DIR"] = (
            path  # read when JAX is imported: a runner sets XLA_FLAGS first
        )
    else:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    # a runner's programs compile in well under JAX's default 1 s threshold, so none would be kept: keep them
    # all (a second run of README's main job: 16 -> 8 s), unless the user set the threshold
    min_time = float(os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"))
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_compilation_cache_dir", path or None)
        sys.modules["jax"].config.update("jax_persistent_cache_min_compile_time_secs", min_time)


def runner_modules():
    """The modules whose flags the running command reads: ``__main__`` first, then jaxpipe's command modules
    and the ``experiments.*`` ones."""
    here = os.path.abspath(getattr(sys.modules["__main__"], "__file__", "") or "")
    ours = [
        m
        for m in flags.FLAGS.flags_by_module_dict()
        if os.path.abspath(m) == here or m == "__main__" or m.startswith(FLAG_MODULES)
    ]
    return sorted(ours, key=lambda m: (m.endswith(".common"), m.startswith(FLAG_MODULES), m))


def usage(doc: str | None = None) -> str:
    """The command's docstring, then its flags, grouped by the module that defines them."""
    parts = [(doc if doc is not None else sys.modules["__main__"].__doc__ or "").strip(), ""]
    for m in runner_modules():
        name = m if m.startswith(FLAG_MODULES) else "this command"
        parts += [f"flags of {name}:", flags.FLAGS.module_help(m), ""]
    parts.append("--helpfull lists every flag (absl's and JAX's too).")
    return "\n".join(parts)


#: what ``--schedule`` says of a schedule of one's own, in every command that takes one
OWN_SCHEDULE_HELP = (
    "; or a schedule of your own: a file in PyTorch's CSV format (one row per device, cells such as 0F1, "
    "1I0, 1W0, 1B0, blank for idle; {M} in the path stands for --microbatches), read by "
    "jaxpipe.schedules.from_csv"
)


def schedule_file(value: str, microbatches: int):
    """The user's own schedule ``--schedule=value`` names, where ``value`` is a path ending in ``.csv``
    (PyTorch's CSV format, read by :func:`jaxpipe.schedules.from_csv`; ``{M}`` in it stands for
    ``microbatches``); None for a schedule's name.

    Raises:
        absl.app.UsageError: no such file, or a schedule that does not validate (the action and the
            dependency it breaks)."""
    if not value.endswith(".csv"):
        return None
    from jaxpipe import schedules

    path = value.replace("{M}", str(microbatches))
    if not os.path.isfile(path):
        raise app.UsageError(
            f"--schedule={value}: no file {path!r}; a schedule of your own is a CSV file in PyTorch's format "
            f"(one row per device; {{M}} in the path stands for --microbatches={microbatches})"
        )
    try:
        return schedules.from_csv(path)
    except schedules.ScheduleError as e:
        raise app.UsageError(f"--schedule={path}: {e}") from None
