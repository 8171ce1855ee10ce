"""PyTorch's own pipeline schedules (``torch.distributed.pipelining``) on the two-process testbed: the peer
:mod:`experiments.peer` times beside jaxpipe's.

The same work as :mod:`experiments.two_devices`: an MLP of ``--layers`` ``tanh(h @ W)`` layers (W
``--width``², no bias), a batch of ``--batch`` rows, the loss the mean square error over the whole batch, SGD
at 1e-3.  Each schedule keeps PyTorch's defaults (``loss_fn=F.mse_loss`` on each micro-batch and
``scale_grads=True``: the gradients summed over the micro-batches and divided by M, the full batch's).  Its
stages: one per rank for ``1f1b``, ``gpipe`` and ``zb_h1`` (``ScheduleInterleavedZeroBubble`` over one
stage a rank), two for ``interleaved_1f1b`` (looped: stages 0, 2 and 1, 3) and for ``zb_v`` and
``dualpipe_v`` (the V: stages 0, 3 and 1, 2).

Run by :mod:`experiments.peer` as a server: two processes (``RANK`` 0 and 1, a core each, Gloo, one thread),
each reading a command a line from standard input -- ``round`` times every schedule's 3 steps in turn once
and answers a JSON line ``{"M,schedule": seconds of a step}`` (rank 0; rank 1 answers ``{}``), ``check``
answers each schedule's largest relative gradient difference from the plain step, ``quit`` ends.  Needs
PyTorch (``pip install "jaxpipe[peer]"``, or a virtual environment of its own: ``--peer_python`` of
:mod:`experiments.peer`)::

    python -m experiments.torch_peer RANK PORT --microbatches=4,8 --schedules=1f1b,zb_v
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

#: jaxpipe's schedule name -> (PyTorch's schedule class name, placement of the stages)
SCHEDULES = {
    "1f1b": ("Schedule1F1B", "one"),
    "gpipe": ("ScheduleGPipe", "one"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "looped"),
    "zb_h1": ("ScheduleInterleavedZeroBubble", "one"),
    "zb_v": ("ScheduleZBVZeroBubble", "v"),
    "dualpipe_v": ("ScheduleDualPipeV", "v"),
}
#: placement -> the stages rank 0 and rank 1 hold
PLACES = {"one": ([0], [1]), "looped": ([0, 2], [1, 3]), "v": ([0, 3], [1, 2])}
LR, SEED = 1e-3, 0


def _arguments(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rank", type=int, choices=(0, 1))
    p.add_argument("port", type=int)
    p.add_argument("--microbatches", default="4,8")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--timeout", type=float, default=300, help="seconds a Gloo operation may wait")
    return p.parse_args(argv)


def _workload(torch, args):
    g = torch.Generator().manual_seed(SEED)
    ws = [torch.randn(args.width, args.width, generator=g) / args.width**0.5 for _ in range(args.layers)]
    return (
        ws,
        torch.randn(args.batch, args.width, generator=g),
        torch.randn(args.batch, args.width, generator=g),
    )


def _layers(torch, ws):
    """A run of consecutive layers ``h = tanh(h @ W)`` as a module."""

    class Layers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in ws])

        def forward(self, h):
            for w in self.w:
                h = torch.tanh(h @ w)
            return h

    return Layers()


class Pipe:
    """This rank's part of one schedule at one micro-batch count: its stages, schedule and optimizer."""

    def __init__(self, torch, pipelining, name, M, ws, x, y, rank, timeout):
        import torch.nn.functional as F
        from torch.distributed.pipelining import schedules

        cls_name, place = SCHEDULES[name]
        cls = getattr(pipelining, cls_name)
        mine = PLACES[place][rank]
        n_stages = 2 * len(mine)
        per = len(ws) // n_stages
        if per * n_stages != len(ws):
            raise SystemExit(f"--layers={len(ws)} does not divide into {n_stages} stages for {name}")
        group = torch.distributed.new_group(
            [0, 1], backend="gloo", timeout=datetime.timedelta(seconds=timeout)
        )
        self.layers = {s: range(s * per, (s + 1) * per) for s in mine}
        self.mods = [_layers(torch, [ws[i] for i in self.layers[s]]) for s in mine]
        stages = [
            pipelining.PipelineStage(mod, s, n_stages, torch.device("cpu"), group=group)
            for mod, s in zip(self.mods, mine)
        ]
        single = issubclass(cls, schedules.PipelineScheduleSingle)
        self.schedule = cls(stages[0] if single else stages, n_microbatches=M, loss_fn=F.mse_loss)
        self.opt = torch.optim.SGD([p for mod in self.mods for p in mod.parameters()], lr=LR)
        self.args = (x,) if 0 in mine else ()
        self.target = y if n_stages - 1 in mine else None

    def grads(self):
        self.schedule.step(*self.args, target=self.target, return_outputs=False)

    def step(self):
        self.grads()
        self.opt.step()
        self.opt.zero_grad()

    def weights(self):
        """``{layer index: its weight parameter}`` on this rank."""
        return {i: w for s, mod in zip(self.layers, self.mods) for i, w in zip(self.layers[s], mod.w)}


def _plain(torch, ws, x, y, M):
    """The plain one-process step of the same work: M micro-batches' gradients accumulated, one SGD step."""
    import torch.nn.functional as F

    model = _layers(torch, ws)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def grads():
        for xm, ym in zip(x.tensor_split(M), y.tensor_split(M)):
            (F.mse_loss(model(xm), ym) / M).backward()

    def step():
        grads()
        opt.step()
        opt.zero_grad()

    step.model, step.grads = model, grads
    return step


def _timed(step, steps=3, settle=1):
    """Seconds a step of ``step``, over ``steps`` timed after ``settle`` untimed (as jaxpipe's rounds: the
    first step after another schedule's runs slow, ``experiments.bench.round_steps``)."""
    for _ in range(settle):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def serve(args):
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    ws, x, y = _workload(torch, args)
    counts = [int(m) for m in args.microbatches.split(",")]
    names = args.schedules.split(",")
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise SystemExit(f"torch_peer: no PyTorch schedule for {unknown}; it has {', '.join(SCHEDULES)}")
    pipes = {
        f"{M},{n}": Pipe(torch, pipelining, n, M, ws, x, y, args.rank, args.timeout)
        for M in counts
        for n in names
    }
    plains = {f"{M},plain": _plain(torch, ws, x, y, M) for M in counts} if args.rank == 0 else {}
    for step in [p.step for p in pipes.values()] + list(plains.values()):
        step(), step()  # warm up
    dist.barrier()
    print(json.dumps({"ready": torch.__version__}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command == "round":
            got = {}
            for key, pipe in pipes.items():
                dist.barrier()
                got[key] = _timed(pipe.step)
            dist.barrier()
            for key, step in plains.items():  # rank 0 alone on its core; rank 1 waits at the barrier
                got[key] = _timed(step)
            dist.barrier()
            print(json.dumps(got if args.rank == 0 else {}), flush=True)
        elif command == "check":
            print(json.dumps(_check(torch, pipelining, pipes, (ws, x, y), counts, args)), flush=True)
        else:
            raise SystemExit(f"torch_peer: unknown command {command!r} (round, check, quit)")
    dist.barrier()
    dist.destroy_process_group()


def _check(torch, pipelining, pipes, work, counts, args):
    """``{"M,schedule": largest |g - g_plain| / max |g_plain|}``: one step's gradients of each schedule
    against the plain step's (fresh weights; the timed pipes are left as they are)."""
    dist, (ws, x, y), out = torch.distributed, work, {}
    for M in counts:
        plain = _plain(torch, ws, x, y, M)
        plain.grads()
        ref = {i: w.grad for i, w in enumerate(plain.model.w)}
        for key in [k for k in pipes if k.startswith(f"{M},")]:
            name = key.split(",", 1)[1]
            pipe = Pipe(torch, pipelining, name, M, ws, x, y, args.rank, args.timeout)
            pipe.grads()
            err = max(
                ((w.grad - ref[i]).abs().max() / ref[i].abs().max()).item() for i, w in pipe.weights().items()
            )
            worst = torch.tensor([err])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            out[key] = worst.item()
    return out if args.rank == 0 else {}


if __name__ == "__main__":
    serve(_arguments(sys.argv[1:]))
