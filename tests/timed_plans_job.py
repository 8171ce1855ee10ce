"""One process of a two-process CPU job (one device each) whose pipeline times its two plans at the first
step: ``python tests/timed_plans_job.py PROCESS_ID PORT``.  ZB-H1's plans are declared too close to rank, op
costs are measured, both plans are run on every process, and the processes report opposite times (process 0:
ordered faster; process 1: lanes): both must run the ordered plan (process 0's times are sent to every
process), or their programs differ and the job hangs.
Prints ``placement <plan> loss <value>``."""

import os
import sys
import warnings

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
os.environ["JAXPIPE_OP_COSTS"] = "measure"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxpipe as jp  # noqa: E402
from jaxpipe import distributed  # noqa: E402
from jaxpipe.tune import running_costs  # noqa: E402


def main(process_id: int, port: str) -> None:
    import faulthandler

    # a hang prints where each process waits
    faulthandler.dump_traceback_later(int(os.environ.get("JOB_DUMP_S", "200")), exit=True)
    distributed.initialize(f"127.0.0.1:{port}", 2, process_id, timeout_s=30)
    running_costs.plans_too_close = lambda s, costs: True
    timed = jp.Pipeline._time_plans

    def opposed(self, state, batch):
        timed(self, state, batch)  # every process runs both programs: they hold collectives
        return [1.0, 2.0] if process_id == 0 else [2.0, 1.0]  # (ordered's, lanes'): process 0's must win

    jp.Pipeline._time_plans = opposed
    model = jp.models.residual_mlp(2, in_dim=12, num_classes=5, width=16)
    r = np.random.default_rng(0)
    batch = {"x": r.normal(size=(16, 12)).astype(np.float32), "y": r.integers(0, 5, 16).astype(np.int32)}
    pipe = jp.Pipeline(
        model, mesh=jp.make_mesh(stages=2), schedule="zb_h1", num_microbatches=4, optimizer=optax.sgd(0.1)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a predicted-slower warning may come)
        loss, _ = pipe.loss_and_grad(pipe.init(), pipe.shard_batch(batch))
    print("placement", pipe.placement, "loss", float(loss), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
