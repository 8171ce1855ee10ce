"""``python -m experiments.train``: the installed ``jaxpipe train`` (:mod:`jaxpipe.cli.train`), for a
clone."""

from jaxpipe.cli import train as command
from jaxpipe.cli.common import run

if __name__ == "__main__":
    command.define_flags()
    run(command.main, command.__doc__)
