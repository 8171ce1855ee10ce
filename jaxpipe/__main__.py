"""``python -m jaxpipe <command>``: the ``jaxpipe`` command (:mod:`jaxpipe.cli`)."""

from jaxpipe.cli import main

main()
