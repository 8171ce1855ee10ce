"""What a run leaves beside its ``metrics.jsonl``: the resolved configuration as an absl flag file
(``config.flags``: run it again with ``--flagfile=<out_dir>/config.flags``), and the metrics as TensorBoard event
files (``tensorboard/``, through ``tensorboardX``: ``pip install -e ".[tensorboard]"``).

Why absl flag files for configs: the runners' flags are absl's already, so a flag file needs no new dependency,
takes every flag a runner has (its ``--help`` lists them), can be layered (``--flagfile=a --flagfile=b --lr=1e-3``:
later wins) and is what the saved config is -- one format to write and to read back."""
from __future__ import annotations

import os
from typing import Optional

from absl import flags


def runner_flags():
    """The flags the running runner reads (:func:`experiments.cli.runner_modules`), by name."""
    from experiments.cli import runner_modules
    by_module = flags.FLAGS.flags_by_module_dict()
    return sorted({f.name: f for m in runner_modules() for f in by_module[m]}.values(), key=lambda f: f.name)


def save_config(out_dir: str, skip=("flagfile",)) -> str:
    """Every flag of this runner, as resolved, in ``out_dir/config.flags`` (absl's ``--flagfile`` format)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "config.flags")
    lines = [f.serialize() for f in runner_flags() if f.name not in skip]
    with open(path, "w") as fh:
        fh.write("# the resolved configuration of this run; rerun with --flagfile=" + path + "\n")
        fh.write("\n".join(l for l in lines if l) + "\n")
    return path


class TensorBoard:
    """Scalars to TensorBoard event files in ``logdir`` (``tensorboardX.SummaryWriter``); ``mode``: ``"auto"``
    (written where tensorboardX is installed), ``"true"`` (an error without it) or ``"false"``."""

    def __init__(self, logdir: str, mode: str = "auto"):
        self.writer = None
        if mode == "false":
            return
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            if mode == "true":
                raise ImportError('--tensorboard=true needs tensorboardX: pip install -e ".[tensorboard]" '
                                  '(or pip install tensorboardX)') from None
            return
        self.writer = SummaryWriter(logdir=logdir)

    def scalars(self, step: int, record: dict, skip=("step",)) -> None:
        if self.writer is None:
            return
        for k, v in record.items():
            if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, step)

    def close(self) -> Optional[str]:
        if self.writer is None:
            return None
        self.writer.flush()
        self.writer.close()
        return self.writer.logdir
