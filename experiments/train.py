"""``python -m experiments.train``: the installed ``jaxpipe train`` (:mod:`jaxpipe.cli.train`), for a
clone."""

from jaxpipe.cli import train as command
from jaxpipe.cli.common import run

if __name__ == "__main__":
    run(command.main, command.__doc__)
