"""``python -m experiments.launch``: the installed ``jaxpipe launch`` (:mod:`jaxpipe.cli.launch`), for a
clone."""

from jaxpipe.cli import launch as command
from jaxpipe.cli.common import run

if __name__ == "__main__":
    command.define_flags()
    run(command.main, command.__doc__)
