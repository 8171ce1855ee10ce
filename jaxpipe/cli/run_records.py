"""What a runner leaves beside its ``metrics.jsonl``: the resolved configuration as an absl flag file
(``config.flags``: run it again with ``--flagfile=<out_dir>/config.flags``).  The metrics and their
TensorBoard event files are written by the training loop (``jaxpipe.training.records``).

Why absl flag files for configs: the runners' flags are absl's already, so a flag file needs no new
dependency, takes every flag a runner has (its ``--help`` lists them), can be layered (``--flagfile=a
--flagfile=b --lr=1e-3``:
later wins) and is what the saved config is -- one format to write and to read back."""

from __future__ import annotations

import os
from absl import flags


def runner_flags():
    """The flags the running runner reads (:func:`jaxpipe.cli.common.runner_modules`), by name."""
    from jaxpipe.cli.common import runner_modules

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
