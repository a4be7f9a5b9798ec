"""FSDP2 training with asyncckpt: async sharded checkpoints, crash, resume at any world size.

    torchrun --nproc-per-node 2 examples/train_fsdp.py --dir runs/fsdp --steps 20 --kill-at 12
    torchrun --nproc-per-node 1 examples/train_fsdp.py --dir runs/fsdp --steps 20   # resumes
    torchrun --nproc-per-node 3 examples/train_fsdp.py --dir runs/fsdp --steps 30   # again

In this order, from a fresh ``--dir``: 2 ranks save every 5 steps (``--every``) and
crash after step 12; 1 rank resumes from the last committed save (step 10, or 5 if
step 10 was still being written) and finishes step 20; 3 ranks resume at step 20 and
go on to step 30.

Runs on CPU with the gloo backend. A small MLP is sharded with FSDP2
(``torch.distributed.fsdp.fully_shard``; every parameter becomes a DTensor sharded on
dim 0) and trained with AdamW on deterministic synthetic data: the global batch of
step ``s`` is generated from (SEED, s) and each rank takes its equal slice, so a run
sees the same data whatever its world size.

Checkpoints: every ``--every`` steps (and after the last step) the state
``{"model": ..., "optim": ..., "step": s}`` is saved with
``AsyncCheckpointer(dir, keep_last=2).save_async``; the model and optimizer parts come
from ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` and
hold DTensors, so each rank writes only its shards. Training goes on while the files
are written.

Resume: if ``--dir`` holds a committed checkpoint, the target state dicts are taken
with ``get_state_dict`` and filled in place by ``ckpt.load(target)``, then applied with
``set_state_dict``. The target's DTensors ask for exactly their own shard, whatever
world size saved the checkpoint (resharding load): save with 2 ranks, resume with 1
or 3. A fresh optimizer has no state until its first step; ``get_state_dict``
initializes it itself (torch's ``_init_optim_state``: one ``step()`` with zero
gradients and lr set to 0, which leaves AdamW's parameters unchanged), so the target
already holds every ``exp_avg``/``exp_avg_sq``/``step`` tensor to load into. Checked on
torch 2.13; should a torch version not do that, ``init_optimizer_state`` below does the
same by hand.

Start from published weights: ``--init-from PATH`` (a safetensors file, or a directory
of them as Hugging Face publishes a model, e.g. ``asyncckpt export runs/fsdp model.safetensors
--prefix model --strip-prefix --dtype bf16`` of another run) loads the model's weights
with ``asyncckpt.load_safetensors`` when ``--dir`` holds no checkpoint yet: each rank
reads only its shards, and bf16 weights are cast into the fp32 parameters. A run that
resumes ignores it.

Without torchrun (``python examples/train_fsdp.py ...``) it runs as a group of one.

``--kill-at K``: rank 0 sends itself SIGKILL right after step K (a crash; a save may
be in flight); torchrun then tears down the other ranks.

Preemption: SIGTERM to any rank (a scheduler's notice; ``--term-at K`` makes the last
rank send it to itself during step K) is noted by ``asyncckpt.PreemptionWatch``; at the
end of that step every rank learns of it through ``should_stop()``, they save that step
synchronously, print ``preempted STEP`` and exit 0. A later run resumes from it.

Output (rank 0): ``resume STEP SAVED_WORLD WORLD`` when resuming, ``init PATH`` when
starting from ``--init-from``, ``loss STEP VALUE``
per step (the global-batch loss, repr of the float), ``saved STEP`` as each save is
started, and ``done STEP`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

try:
    from torch.distributed.fsdp import fully_shard  # torch >= 2.6
except ImportError:  # torch 2.4, 2.5
    from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

import asyncckpt

SEED = 20240611
IN_FEATURES, HIDDEN, OUT_FEATURES = 24, 50, 10  # 50 and 10 do not split evenly over 3 ranks
GLOBAL_BATCH = 48  # divisible by 1, 2, 3, 4, 6: every rank gets an equal slice


def make_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (a fixed random teacher's targets)."""
    teacher = torch.randn(IN_FEATURES, OUT_FEATURES, generator=torch.Generator().manual_seed(SEED))
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    x = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=g)
    y = torch.tanh(x @ teacher)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def build(world: int, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)  # the same initial weights on every rank and world size
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT_FEATURES))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return model, opt


def init_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors without changing the parameters."""
    if opt.state:
        return
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def emit(rank: int, *words: object) -> None:
    if rank == 0:
        print(*words, flush=True)


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def resume(ckpt: asyncckpt.AsyncCheckpointer, model: torch.nn.Module,
           opt: torch.optim.Optimizer, rank: int, world: int) -> int:
    """Load the latest committed checkpoint into the model and optimizer; return its step."""
    latest = ckpt.latest_step()
    if latest is None:
        return 0
    target = state_of(model, opt, 0)  # get_state_dict initializes the optimizer state
    if not target["optim"]["state"]:  # (older torch might not: do it by hand)
        init_optimizer_state(model, opt)
        target = state_of(model, opt, 0)
    ckpt.load(target, step=latest)  # in place: each DTensor gets just its own shard
    set_state_dict(model, opt, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    emit(rank, "resume", target["step"], ckpt.manifest(latest).world_size, world)
    return int(target["step"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--dir", required=True, help="checkpoint directory (resumes from it)")
    p.add_argument("--steps", type=int, required=True, help="train until this step")
    p.add_argument("--every", type=int, default=5, help="save every N steps")
    p.add_argument("--kill-at", type=int, default=None,
                   help="rank 0 SIGKILLs itself after this step (simulated crash)")
    p.add_argument("--term-at", type=int, default=None,
                   help="the last rank SIGTERMs itself during this step (simulated preemption)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--init-from", default=None,
                   help="a new run starts from these model weights (a safetensors file or "
                        "directory); ignored when resuming")
    args = p.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        p.error("--steps and --every must be positive")

    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    else:  # plain ``python examples/train_fsdp.py``: a group of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world:
        p.error(f"world size {world} does not divide the global batch {GLOBAL_BATCH}")
    model, opt = build(world, args.lr)
    ckpt = asyncckpt.AsyncCheckpointer(args.dir, keep_last=2)
    preempt = asyncckpt.PreemptionWatch().install()  # SIGTERM: save at the step's end
    try:
        start = resume(ckpt, model, opt, rank, world)
        if start == 0 and args.init_from is not None:
            # each rank reads its own shard of each weight; bf16 files are cast to fp32
            asyncckpt.load_safetensors(args.init_from, model)
            emit(rank, "init", args.init_from)
        if start >= args.steps and rank == 0:
            print(f"the checkpoint is at step {start}, not before --steps {args.steps}: "
                  "nothing to train (pass a larger --steps to go on)", file=sys.stderr,
                  flush=True)
        for step in range(start + 1, args.steps + 1):
            x, y = make_batch(step, rank, world)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # FSDP averages the gradients over the ranks
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            emit(rank, "loss", step, repr(total.item() / world))
            if args.term_at is not None and step == args.term_at and rank == world - 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if preempt.should_stop():  # every rank, every step: did any rank get SIGTERM?
                if ckpt.latest_step() != step:
                    # after the save in flight; durable when it returns. Not ckpt.wait()
                    # or save(): they also wait for keep_last's deletions, and raise an
                    # earlier unwaited save's failure instead of saving this step
                    ckpt.save_async(state_of(model, opt, step), step).wait()
                emit(rank, "preempted", step)
                break
            if step % args.every == 0 or step == args.steps:
                # returns once the shards are copied out; the files are written meanwhile.
                # The loss is recorded with it (asyncckpt ls shows it; keep_best= and
                # best_step() rank steps by such a metric)
                ckpt.save_async(state_of(model, opt, step), step,
                                metrics={"loss": total.item() / world})
                emit(rank, "saved", step)
            if args.kill_at is not None and step == args.kill_at and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            ckpt.wait()
            emit(rank, "done", max(start, args.steps))
    finally:
        preempt.uninstall()
        ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
