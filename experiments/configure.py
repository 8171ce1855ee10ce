"""``python -m experiments.configure``: the installed ``jaxpipe configure`` (:mod:`jaxpipe.cli.configure`),
for a clone."""

from jaxpipe.cli import configure as command
from jaxpipe.cli.common import run

if __name__ == "__main__":
    command.define_flags()
    run(command.main, command.__doc__)
