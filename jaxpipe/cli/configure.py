"""Let jaxpipe choose how to run a model on these devices, and print the command that trains it.

    jaxpipe configure --model=gpt --stages=4 --blocks_per_stage=2   # 4 devices: stage x data, schedule, M
    jaxpipe configure --model=pkg.mod:factory --stages=2 --data=2 --memory_budget_mb=512

The model is ``jaxpipe train``'s (``--model``, its flags), on ``--stages`` x ``--data`` devices.
``jp.configure`` predicts every stage x data split, schedule of ``--auto_schedules``, micro-batch count of
``--auto_microbatches`` and residual policy from measured costs, compiles the few that come first, and picks
the fastest that fits ``--memory_budget_mb``; this prints the candidates' table and the ``jaxpipe train``
flags of the pick.  Nothing is trained (``jaxpipe train --auto`` chooses the same and trains it).
"""

from __future__ import annotations

from jaxpipe.cli import common
from jaxpipe.cli import train


def main(argv):
    """``jaxpipe configure``: :func:`jaxpipe.cli.train.choose`, guarded as ``jaxpipe train`` is."""
    train.FLAGS.auto = True
    train.guarded(train.choose, argv)


#: this command's flags are ``jaxpipe train``'s
define_flags = train.define_flags

if __name__ == "__main__":
    define_flags()
    common.run(main, __doc__)
