"""What a run writes as it goes: one JSON line of metrics per step (``metrics.jsonl``; a resumed run keeps the
lines of the steps its checkpoint holds) and the same scalars as TensorBoard event files (``tensorboard/``,
through ``tensorboardX``: ``pip install -e ".[tensorboard]"``)."""

from __future__ import annotations

import json
import os
from typing import Optional


class MetricsLog:
    """``<out_dir>/metrics.jsonl`` (process 0; the others write nothing).  ``start``: the step a resumed run
    starts after -- the lines of later steps, from the run that stopped, are dropped."""

    def __init__(self, out_dir: str, start: int = 0, primary: bool = True):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        kept = []
        if primary and start and os.path.exists(self.path):
            kept = [l for l in open(self.path) if l.strip() and json.loads(l).get("step", 0) <= start]
        self._fh = open(self.path, "w") if primary else open(os.devnull, "w")
        self._fh.writelines(kept)

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


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
                raise ImportError(
                    'tensorboard="true" needs tensorboardX: pip install -e ".[tensorboard]" '
                    "(or pip install tensorboardX)"
                ) from None
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
        logdir, self.writer = self.writer.logdir, None
        return logdir
