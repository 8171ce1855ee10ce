"""The ``jaxpipe`` command (installed with the package), one subcommand a task, absl flags each:

    jaxpipe train --model=mlp --stages=2 --steps=100        # bundled, or --model=pkg.mod:factory
    jaxpipe launch --num_processes=2 -- --model=mlp          # a multi-process job on this machine
    jaxpipe configure --model=gpt --stages=4                 # let jaxpipe choose the split, schedule and M
    jaxpipe timeline --schedule=zb_v --stages=4              # draw a schedule
    jaxpipe <command> --help                                 # a command's flags

``python -m jaxpipe.cli.<command>`` (and, in a clone, ``python -m experiments.<command>``) runs the same code.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # the module whose ``main(argv)`` runs it and whose ``define_flags()`` defines its flags
    summary: str


COMMANDS = {
    "train": Command("jaxpipe.cli.train", "train a pipelined model: checkpoints, resume, stops, evaluation"),
    "launch": Command("jaxpipe.cli.launch", "start a multi-process job on this machine (jax.distributed)"),
    "configure": Command(
        "jaxpipe.cli.configure",
        "choose the stage x data split, schedule, micro-batches "
        "and residuals for a model, and print the command",
    ),
    "timeline": Command("jaxpipe.cli.timeline", "draw a schedule's timeline and print its simulated bubble"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: jaxpipe <command> [flags]   (jaxpipe <command> --help: its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> None:
    """The console script: ``jaxpipe <command> [flags]`` runs ``COMMANDS[command]`` with the flags."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if len(argv) >= 2 else 2)
    if argv[1] in ("--version", "version"):
        from jaxpipe import __version__

        print(f"jaxpipe {__version__}")
        sys.exit(0)
    command = COMMANDS.get(argv[1])
    if command is None:
        sys.stderr.write(f"jaxpipe: unknown command {argv[1]!r}\n\n{usage()}\n")
        sys.exit(2)
    sys.argv = [f"jaxpipe {argv[1]}", *argv[2:]]
    module = importlib.import_module(command.module)
    from jaxpipe.cli import common

    module.define_flags()
    common.run(module.main, module.__doc__)
