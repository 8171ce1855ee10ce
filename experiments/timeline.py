"""``python -m experiments.timeline``: the installed ``jaxpipe timeline`` (:mod:`jaxpipe.cli.timeline`), for a
clone."""

from jaxpipe.cli import timeline as command
from jaxpipe.cli.common import run

if __name__ == "__main__":
    command.define_flags()
    run(command.main, command.__doc__)
