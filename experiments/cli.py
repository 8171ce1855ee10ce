"""What every runner's ``python -m experiments.<runner>`` shares: ``--help`` that lists the runner's own flags
(those it imports from another runner included) and exits 0 -- absl's exits 1, and lists only the flags the
``__main__`` module itself defines."""
from __future__ import annotations

import os
import sys

from absl import app, flags

HELP = ("--help", "-h", "-?", "--helpshort")


def run(main) -> None:
    """``absl.app.run(main)``, after answering ``--help`` (before a ``--``: what follows is a worker's)."""
    argv = sys.argv[1:]
    own = argv[:argv.index("--")] if "--" in argv else argv
    if any(a in HELP for a in own):
        print(usage())
        sys.exit(0)
    app.run(main)


def usage() -> str:
    """The runner's docstring, then its flags, grouped by the module that defines them."""
    main = sys.modules["__main__"]
    by_module = flags.FLAGS.flags_by_module_dict()
    here = os.path.abspath(getattr(main, "__file__", "") or "")
    ours = [m for m in by_module if os.path.abspath(m) == here or m == "__main__" or m.startswith("experiments")]
    ours.sort(key=lambda m: (m.startswith("experiments"), m))        # the runner's own flags first
    parts = [(main.__doc__ or "").strip(), ""]
    for m in ours:
        name = m if m.startswith("experiments") else "this runner"
        parts += [f"flags of {name}:", flags.FLAGS.module_help(m), ""]
    parts.append("--helpfull lists every flag (absl's and JAX's too).")
    return "\n".join(parts)
