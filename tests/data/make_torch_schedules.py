"""Writes PyTorch's own orders of Interleaved 1F1B, ZBV and DualPipeV as CSV files, one row per rank, as
``torch.distributed.pipelining`` lists them (``_schedule_visualizer.get_schedule_ops``; a blank cell is an
idle step). Run with a Python that has torch (the CPU build is enough; tested with torch 2.13.0):

    python tests/data/make_torch_schedules.py
"""

import csv
import os

from torch.distributed.pipelining import _schedule_visualizer

HERE = os.path.dirname(os.path.abspath(__file__))
#: file name -> (PyTorch's schedule name, ranks, micro-batches, stages per rank)
ORDERS = {
    "torch_interleaved_1f1b_d2_m4.csv": ("Interleaved1F1B", 2, 4, 2),
    "torch_interleaved_1f1b_d2_m8.csv": ("Interleaved1F1B", 2, 8, 2),
    "torch_zbv_d2_m4.csv": ("ZBVZeroBubble", 2, 4, 2),
    "torch_zbv_d2_m8.csv": ("ZBVZeroBubble", 2, 8, 2),
    "torch_zbv_d4_m8.csv": ("ZBVZeroBubble", 4, 8, 2),
    "torch_dualpipev_d2_m4.csv": ("DualPipeV", 2, 4, 2),
    "torch_dualpipev_d2_m8.csv": ("DualPipeV", 2, 8, 2),
}

if __name__ == "__main__":
    for name, (schedule, ranks, microbatches, per_rank) in ORDERS.items():
        rows = _schedule_visualizer.get_schedule_ops(schedule, ranks, microbatches, per_rank)
        with open(os.path.join(HERE, name), "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerows(
                [["" if a is None else str(a) for a in row] for row in rows]
            )
        print("wrote", name)
