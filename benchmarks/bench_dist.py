"""The world-size-N section of the checkpoint benchmark (``--only dist``; N = ``--world``, 2).

N rank processes (gloo on 127.0.0.1) hold the benchmark's state between them: the same
GPT-like model + AdamW moments as ``bench_checkpoint.py``, every tensor a DTensor
``Shard(0)`` over a 1-D CPU mesh of N (the 0-d ``step`` scalars ``Replicate()``), so each
rank holds ~1/N of the bytes. Each rank builds only its own shards, from seeds, so any
process can rebuild any tensor to check a load. Measured, in one run:

* limits   -- each rank copying its shards into a pre-touched buffer, all ranks at once
              (the per-rank copy limit); an O_DIRECT write + fsync of the whole checkpoint's
              bytes from this process (the disk limit), and the ranks writing their parts at
              once (reference); a cold sequential read of the whole (reference);
* saves    -- asyncckpt ``mode="async"`` and DCP ``async_save`` with its best options on a
              CPU-only torch: per-rank blocked / staged / durable and the global commit time
              (latest end over the ranks minus the earliest start), first saves apart, and
              asyncckpt's first save again after ``ckpt.prepare(state)``;
* loads    -- the last checkpoint of each library, cold (page cache of its files dropped)
              and hot: (a) into the same ``Shard(0)`` layout, (b) into ``Shard(1)`` (true
              resharding: every rank needs half of every saved chunk; 1-D tensors become
              ``Replicate()``), and (c) asyncckpt only: whole, in this one process, with
              ``asyncckpt.load(dir)``. Every load checks a few tensors against the seeds.

Run it through ``bench_checkpoint.py --only dist`` (or this file, which does just that).
A rank runs as ``python bench_dist.py --rank-worker <spec.json>``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import faulthandler
import functools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

import _limits as lim
import asyncckpt
import bench_checkpoint as bc
from asyncckpt.dist import dtensor_module

GB = 1e9
GiB = 2**30
MiB = 2**20
HERE = Path(__file__).resolve().parent
KINDS = ("model", "exp_avg", "exp_avg_sq", "step")


def now() -> float:
    """CLOCK_MONOTONIC: one clock for every process of this machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def median(xs: Sequence[float]) -> float:
    return bc.median(list(xs))


# --- the layout: which tensors, which shards, which values --------------------------------


@dataclass(frozen=True)
class Leaf:
    """One tensor of the state: its path (``model/<name>``, ``optim/state/<i>/<kind>``)."""

    path: str
    index: int
    kind: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4


def layout(model_floats: int, n_tensors: int) -> list[Leaf]:
    """The leaves of ``bench_checkpoint.build_state``'s tree, in its order."""
    out = []
    for i, (name, shape) in enumerate(bc.model_shapes(model_floats, n_tensors).items()):
        out.append(Leaf(f"model/{name}", i, "model", shape))
    for i, (_, shape) in enumerate(bc.model_shapes(model_floats, n_tensors).items()):
        out += [Leaf(f"optim/state/{i}/step", i, "step", ()),
                Leaf(f"optim/state/{i}/exp_avg", i, "exp_avg", shape),
                Leaf(f"optim/state/{i}/exp_avg_sq", i, "exp_avg_sq", shape)]
    return out


def chunk(n: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, length) of ``rank``'s part of ``n`` under Shard: torch.chunk's rule."""
    size = -(-n // world) if n else 0
    lo = min(rank * size, n)
    return lo, min(lo + size, n) - lo


def saved_local_shape(leaf: Leaf, world: int, rank: int) -> tuple[int, ...]:
    if not leaf.shape:
        return ()
    return (chunk(leaf.shape[0], world, rank)[1], *leaf.shape[1:])


def local_values(leaf: Leaf, world: int, rank: int) -> torch.Tensor:
    """The saved shard of ``leaf`` on ``rank``: seeded, so anyone can rebuild it."""
    if leaf.kind == "step":
        return torch.tensor(float(1000 + leaf.index))
    g = torch.Generator().manual_seed(zlib.crc32(f"{leaf.path}@{rank}/{world}".encode()))
    t = torch.empty(saved_local_shape(leaf, world, rank)).normal_(generator=g)
    if leaf.kind == "exp_avg":
        t.mul_(1e-3)
    elif leaf.kind == "exp_avg_sq":
        t.abs_().mul_(1e-6)
    return t


def full_values(leaf: Leaf, world: int) -> torch.Tensor:
    """The global value of ``leaf``: its saved shards put back together."""
    if leaf.kind == "step":
        return local_values(leaf, world, 0)
    return torch.cat([local_values(leaf, world, r) for r in range(world)], dim=0)


def probe_leaves(leaves: Sequence[Leaf]) -> list[Leaf]:
    """A few leaves that every load checks: first, middle and last model tensors (2-D and
    1-D), an AdamW moment of each kind and a step scalar."""
    model = [lf for lf in leaves if lf.kind == "model"]
    picks = [model[0], model[len(model) // 2], model[-1],
             next(lf for lf in model if len(lf.shape) == 1),
             next(lf for lf in leaves if lf.kind == "exp_avg" and lf.index == len(model) // 3),
             next(lf for lf in leaves if lf.kind == "exp_avg_sq" and lf.index == len(model) - 1),
             next(lf for lf in leaves if lf.kind == "step" and lf.index == len(model) // 2)]
    seen: dict[str, Leaf] = {}
    for lf in picks:
        seen.setdefault(lf.path, lf)
    return list(seen.values())


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"model/a": t, "optim/state/0/step": s}`` -> the nested tree (int optimizer keys)."""
    tree: dict[Any, Any] = {}
    for path, value in flat.items():
        parts: list[Any] = path.split("/")
        if parts[0] == "optim":
            parts[2] = int(parts[2])
        else:
            parts = [parts[0], "/".join(parts[1:])]
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return tree


def flat_of(tree: Any) -> dict[str, torch.Tensor]:
    return dict(bc.named_tensors(tree))


# --- the parent: limits, spawning the ranks, the one-process load, the report --------------


def run(args: Any, work: Path) -> dict[str, Any]:
    """Run the section with ``args`` of bench_checkpoint (world, state_gib, tensors,
    repeats, dcp_threads); checkpoints go under ``work``, which is removed afterwards."""
    started = now()
    world = int(getattr(args, "world", 2) or 2)
    if world < 2:
        raise ValueError(f"--world {world}: the dist section needs at least 2 ranks")
    model_floats = int(args.state_gib * GiB / 12)
    leaves = layout(model_floats, args.tensors)
    total = sum(lf.nbytes for lf in leaves)
    rank_bytes = [sum(math.prod(saved_local_shape(lf, world, r)) * 4 for lf in leaves)
                  for r in range(world)]
    timeout_s = 150.0 + 400.0 * args.state_gib
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "world": world, "state_bytes": total, "rank_bytes": rank_bytes,
        "tensors": len(leaves), "model_tensors": sum(lf.kind == "model" for lf in leaves),
        "repeats": args.repeats, "torch_threads_per_rank": 1, "dcp_threads": args.dcp_threads,
        "timeout_s": timeout_s}
    try:
        with SystemMemory() as mem:
            bc.log(f"dist: limits in this process ({total / GiB:.3f} GiB)")
            res["limits"] = parent_limits(work, total, args.repeats)
            bc.free_memory()
            spec = {"world": world, "work": str(work), "model_floats": model_floats,
                    "tensors": args.tensors, "repeats": args.repeats,
                    "dcp_threads": args.dcp_threads, "timeout_s": timeout_s}
            ranks = spawn_ranks(spec, world, work, timeout_s)
            res["ranks"] = ranks
            bc.log("dist: whole load in this process")
            res["whole"] = whole_load(work / "asyncckpt", leaves, world, args.repeats)
            bc.free_memory()
        res["memory"] = {"baseline_used_bytes": mem.baseline, "peak_extra_used_bytes":
                         mem.peak - mem.baseline,
                         "rank_peak_rss_bytes": [ranks[r]["peak_rss_bytes"] for r in range(world)]}
        summarize(res)
        res["targets"] = [{**asdict(t), "verdict": t.verdict} for t in evaluate(res)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["wall_s"] = now() - started
    return res


class SystemMemory:
    """Samples the machine's used memory (total - available: counts shared memory too)."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.baseline = self._used()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mem-sampler", daemon=True)

    @staticmethod
    def _used() -> int:
        vm = psutil.virtual_memory()
        return int(vm.total - vm.available)

    def __enter__(self) -> SystemMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._used())


def parent_limits(work: Path, total: int, repeats: int) -> dict[str, Any]:
    """O_DIRECT write + fsync of the whole checkpoint's bytes (the disk limit), and a cold
    sequential read of it (reference), from one pre-touched buffer."""
    out: dict[str, Any] = {"odirect_write_s": [], "cold_read_s": [], "cold_drop": [],
                           "cold_residency": []}
    buf = lim.AlignedBuffer(total)
    mv = buf.memoryview()
    path = work / "limits.bin"
    try:
        for r in range(repeats):
            w, direct = lim.odirect_write(path, mv, total)
            out["odirect_write_s"].append(w)
            out["odirect"] = direct
            drop = lim.drop_cache(path)
            out["cold_drop"].append(drop.method)
            out["cold_residency"].append(drop.residency_after)
            out["cold_read_s"].append(lim.sequential_read(path, mv)[0])
            bc.log(f"dist limits {r + 1}/{repeats}: O_DIRECT write {w:.3f}s, cold read "
                   f"{out['cold_read_s'][-1]:.3f}s")
            path.unlink()
    finally:
        del mv
        buf.close()
        del buf
        path.unlink(missing_ok=True)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(spec: dict[str, Any], world: int, work: Path, timeout_s: float
                ) -> dict[int, dict[str, Any]]:
    """Run ``world`` rank processes; forward their logs; kill all on a failure or timeout.

    Returns each rank's result; raises RuntimeError with the failed ranks' log tails.
    """
    spec = {**spec, "port": free_port()}
    env = dict(os.environ)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec["port"]),
                "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([
                    str(HERE), str(Path(asyncckpt.__file__).resolve().parent.parent),
                    *filter(None, [os.environ.get("PYTHONPATH")])])})
    procs: dict[int, subprocess.Popen[bytes]] = {}
    logs = {r: work / f"rank_{r}.log" for r in range(world)}
    pos = dict.fromkeys(range(world), 0)

    def forward() -> None:
        for r, p in logs.items():
            if not p.exists():
                continue
            with open(p, "rb") as f:
                f.seek(pos[r])
                data = f.read()
            cut = data.rfind(b"\n") + 1
            if cut:
                sys.stderr.write(data[:cut].decode(errors="replace"))
                sys.stderr.flush()
                pos[r] += cut

    failed: list[int] = []
    timed_out = False
    try:
        for r in range(world):
            spec_path = work / f"spec_{r}.json"
            spec_path.write_text(json.dumps({**spec, "rank": r}))
            with open(logs[r], "wb") as log:
                procs[r] = subprocess.Popen(
                    [sys.executable, str(HERE / "bench_dist.py"), "--rank-worker",
                     str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                    # what torchrun tells its ranks about this machine's share of them
                    env={**env, "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world)},
                    cwd=str(work), start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs.values()):
            forward()
            failed = [r for r, p in procs.items() if p.returncode not in (None, 0)]
            if failed:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGKILL)
            p.wait()
        forward()
    failed = [r for r, p in procs.items() if p.returncode != 0]
    if timed_out or failed:
        parts = [f"dist: {world} ranks " + (f"hit the hard timeout of {timeout_s:.0f}s"
                                            if timed_out else "failed")]
        for r in sorted(set(failed) | (set(procs) if timed_out else set())):
            text = logs[r].read_text(errors="replace")
            parts.append(f"----- rank {r} (exit status {procs[r].returncode}) -----\n"
                         + text[-6000:])
        raise RuntimeError("\n".join(parts))
    return {r: json.loads((work / f"result_{r}.json").read_text()) for r in range(world)}


def whole_load(root: Path, leaves: Sequence[Leaf], world: int, repeats: int
               ) -> dict[str, Any]:
    """(c): ``asyncckpt.load(root)`` in this one process, cold then hot, checked."""
    out: dict[str, Any] = {"cold_s": [], "hot_s": [], "cold_drop": [], "cold_residency": [],
                           "hot_residency": [], "checked_tensors": 0}
    step_dir = next(p for p in root.iterdir() if p.name.startswith("step_"))
    probes = {lf.path: full_values(lf, world) for lf in probe_leaves(leaves)}
    shapes = {lf.path: lf.shape for lf in leaves}

    def check(tree: Any, who: str) -> None:
        flat = flat_of(tree)
        if set(flat) != set(shapes):
            raise RuntimeError(f"{who}: loaded keys differ: {sorted(set(flat) ^ set(shapes))[:5]}")
        for path, t in flat.items():
            if tuple(t.shape) != shapes[path]:
                raise RuntimeError(f"{who}: {path} has shape {list(t.shape)}, want "
                                   f"{list(shapes[path])}")
        for path, want in probes.items():
            if not torch.equal(flat[path], want):
                raise RuntimeError(f"{who}: {path} differs from the saved values")
        out["checked_tensors"] += len(probes)

    for r in range(repeats):
        drop = lim.drop_cache(step_dir)
        out["cold_drop"].append(drop.method)
        out["cold_residency"].append(drop.residency_after)
        t0 = now()
        tree = asyncckpt.load(root)
        out["cold_s"].append(now() - t0)
        check(tree, "whole load (cold)")
        del tree
        bc.free_memory()
        out["hot_residency"].append(lim.residency(step_dir))
        t0 = now()
        tree = asyncckpt.load(root)
        out["hot_s"].append(now() - t0)
        check(tree, "whole load (hot)")
        del tree
        bc.free_memory()
        bc.log(f"dist whole load {r + 1}/{repeats}: cold {out['cold_s'][-1]:.3f}s hot "
               f"{out['hot_s'][-1]:.3f}s")
    return out


# --- the ranks -------------------------------------------------------------------------------


class RankBench:
    """What one rank measures; every timed event starts right after a barrier."""

    def __init__(self, spec: dict[str, Any]):
        from torch.distributed.device_mesh import init_device_mesh

        self.spec = spec
        self.rank: int = spec["rank"]
        self.world: int = spec["world"]
        self.work = Path(spec["work"])
        self.repeats: int = spec["repeats"]
        self.leaves = layout(spec["model_floats"], spec["tensors"])
        self.probes = probe_leaves(self.leaves)
        self.full = {lf.path: full_values(lf, self.world) for lf in self.probes}
        self.mesh = init_device_mesh("cpu", (self.world,))
        self.out: dict[str, Any] = {"rank": self.rank, "checked": {}}
        self._paired: tuple[lim.AlignedBuffer, dict[str, Callable[[], object]], Path, int] | None
        self._paired = None

    # helpers

    def log(self, msg: str) -> None:
        print(f"[dist r{self.rank} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def dtensor(self, local: torch.Tensor, placements: list[Any], shape: tuple[int, ...]
                ) -> torch.Tensor:
        DTensor = dtensor_module().DTensor

        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(local, self.mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    def build_state(self) -> dict[str, Any]:
        Replicate, Shard = dtensor_module().Replicate, dtensor_module().Shard

        flat: dict[str, torch.Tensor] = {}
        for lf in self.leaves:
            local = local_values(lf, self.world, self.rank)
            flat[lf.path] = self.dtensor(local, [Shard(0)] if lf.shape else [Replicate()],
                                         lf.shape)
        self._check_boxes(flat)
        return nest(flat)

    def build_target_shard1(self) -> dict[str, Any]:
        """Zeros laid out ``Shard(1)`` (2-D and up), ``Replicate()`` (0-d and 1-D)."""
        Replicate, Shard = dtensor_module().Replicate, dtensor_module().Shard

        flat: dict[str, torch.Tensor] = {}
        for lf in self.leaves:
            if len(lf.shape) >= 2:
                _, n = chunk(lf.shape[1], self.world, self.rank)
                local = torch.zeros((lf.shape[0], n, *lf.shape[2:]))
                flat[lf.path] = self.dtensor(local, [Shard(1)], lf.shape)
            else:
                flat[lf.path] = self.dtensor(torch.zeros(lf.shape), [Replicate()], lf.shape)
        self._check_boxes(flat)
        return nest(flat)

    def _check_boxes(self, flat: dict[str, torch.Tensor]) -> None:
        compute_local_shape_and_global_offset = (
            dtensor_module("_utils").compute_local_shape_and_global_offset)

        for path, t in flat.items():
            shape, _ = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                             t.placements)
            if tuple(shape) != tuple(t.to_local().shape):  # type: ignore[attr-defined]
                raise RuntimeError(f"{path}: local shape {list(t.to_local().shape)} is not "
                                   f"torch's {list(shape)}")

    def expected(self, path: str, t: torch.Tensor) -> torch.Tensor:
        compute_local_shape_and_global_offset = (
            dtensor_module("_utils").compute_local_shape_and_global_offset)

        shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                               t.placements)
        full = self.full[path]
        index = tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))
        return full[index] if index else full

    @contextlib.contextmanager
    def probed(self, tree: Any, who: str) -> Iterator[None]:
        """Zero the probe tensors' local shards; after the block, check they were loaded."""
        flat = flat_of(tree)
        with torch.no_grad():
            for lf in self.probes:
                flat[lf.path].to_local().zero_()  # type: ignore[attr-defined]
        yield
        for lf in self.probes:
            got = flat[lf.path].to_local()  # type: ignore[attr-defined]
            if not torch.equal(got, self.expected(lf.path, flat[lf.path])):
                raise RuntimeError(f"rank {self.rank}: {who} did not restore {lf.path}")
        self.out["checked"][who] = self.out["checked"].get(who, 0) + len(self.probes)

    def remove(self, path: Path) -> None:
        """Rank 0 removes ``path`` while the others wait (outside every timing)."""
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.barrier()

    def drop(self, path: Path) -> dict[str, Any]:
        """Drop the page cache of every file under ``path`` (rank 0), all ranks waiting."""
        self.barrier()
        report: dict[str, Any] = {}
        if self.rank == 0:
            d = lim.drop_cache(path)
            report = {"method": d.method, "residency_after": d.residency_after}
        self.barrier()
        return report

    # the phases

    def run(self) -> dict[str, Any]:
        t0 = now()
        state = self.build_state()
        mine = sum(math.prod(saved_local_shape(lf, self.world, self.rank)) * 4
                   for lf in self.leaves)
        self.log(f"built {mine / GiB:.3f} GiB of local shards in {now() - t0:.1f}s")
        self.out["limits"] = self.limits(state)
        bc.free_memory()
        self.out["asyncckpt"] = self.asyncckpt_saves(state)
        self.close_paired()
        bc.free_memory()
        root = self.work / "asyncckpt"
        self.out["asyncckpt_loads"] = self.loads(
            "asyncckpt", state, lambda tree: asyncckpt.load(root, tree), root)
        bc.free_memory()
        self.out["dcp"], dcp_dir, pg = self.dcp_saves(state)
        bc.free_memory()
        self.out["dcp_loads"] = self.loads("DCP", state, lambda tree: self.dcp_load(
            tree, dcp_dir, pg), dcp_dir)
        self.remove(self.work / "dcp")
        bc.free_memory()
        self.out["peak_rss_bytes"] = lim.peak_rss_bytes()
        return self.out

    def limits(self, state: Any) -> dict[str, Any]:
        """Copy into a pre-touched buffer, all ranks at once; then O_DIRECT write of this
        rank's part, all ranks at once (reference)."""
        tensors = [t.to_local() for t in flat_of(state).values()]  # type: ignore[attr-defined]
        buf = lim.AlignedBuffer(lim.packed_nbytes(tensors))
        views = buf.views_like(tensors)
        lim.copy_tensors(views, tensors)  # warm-up
        # Candidates, round-robin, all ranks at once: torch's copy_ (one thread per rank)
        # and memcpy split over several threads per rank (more, all ranks together, than
        # this machine may have cores: the faster of the two is the limit).
        k = max(2, min(4, os.cpu_count() or 1))
        candidates: dict[str, Callable[[], object]] = {
            "torch copy_ per tensor": functools.partial(lim.copy_tensors, views, tensors),
            f"memcpy per tensor, {k} threads per rank": functools.partial(
                lim.memcpy_tensors, views, tensors, k)}
        out: dict[str, Any] = {"copy_by_method": {m: [] for m in candidates},
                               "odirect_part": []}
        for _ in range(self.repeats):
            for label, fn in candidates.items():
                self.barrier()
                t0 = now()
                fn()
                out["copy_by_method"][label].append({"t0": t0, "t1": now()})
        path = self.work / f"limits_part_{self.rank}.bin"
        mv = buf.memoryview()
        nbytes = lim.packed_nbytes(tensors)
        for _ in range(self.repeats):
            self.barrier()
            t0 = now()
            lim.odirect_write(path, mv, nbytes)
            out["odirect_part"].append({"t0": t0, "t1": now()})
            path.unlink()
        out["bytes"] = nbytes
        def secs(events: list[dict[str, float]]) -> str:
            return ", ".join(f"{e['t1'] - e['t0']:.3f}s" for e in events)

        self.log("limits: copy " + "; ".join(f"{m}: {secs(ev)}"
                                             for m, ev in out["copy_by_method"].items())
                 + "; O_DIRECT part " + secs(out["odirect_part"]))
        del mv
        # Kept for the limits measured again beside each asyncckpt save (see paired_*).
        self._paired = (buf, candidates, path, nbytes)
        return out

    def paired_copy(self) -> dict[str, dict[str, float]]:
        """The copy limit again, all ranks at once, right before a save: every candidate."""
        assert self._paired is not None
        buf, candidates, _, _ = self._paired
        out = {}
        for label, fn in candidates.items():
            buf.tensor.fill_(1)  # untimed: a copy into a pre-touched buffer
            self.barrier()
            t0 = now()
            fn()
            out[label] = {"t0": t0, "t1": now()}
        return out

    def paired_write(self) -> dict[str, float]:
        """Each rank's O_DIRECT write of its part again, all ranks at once, beside a save."""
        assert self._paired is not None
        buf, _, path, nbytes = self._paired
        mv = buf.memoryview()
        try:
            self.barrier()
            t0 = now()
            lim.odirect_write(path, mv, nbytes)
            return {"t0": t0, "t1": now()}
        finally:
            del mv
            path.unlink(missing_ok=True)

    def close_paired(self) -> None:
        if self._paired is not None:
            self._paired[0].close()
            self._paired = None

    def asyncckpt_saves(self, state: Any) -> dict[str, Any]:
        """First save (arena allocated in it), ``repeats`` saves; then a fresh checkpointer
        whose ``prepare(state)`` ran ahead, and its first save. Keeps the last step of the
        first checkpointer for the loads."""
        root = self.work / "asyncckpt"
        out: dict[str, Any] = {"saves": []}
        ckpt = asyncckpt.AsyncCheckpointer(root, mode="async", timeout_s=self.spec["timeout_s"])
        try:
            for step in range(self.repeats + 1):
                if step >= 2:  # the previous step goes, outside the timings
                    self.remove(root / f"step_{step - 2:09d}")
                # Beside every timed save: the copy limit right before it, and the O_DIRECT
                # write after it (even repeats) or before it (odd), as in bench_checkpoint.
                paired = step >= 1 and self._paired is not None
                write_first = step % 2 == 0
                beside: dict[str, Any] = {}
                if paired and write_first:
                    beside["paired_write"] = self.paired_write()
                if paired:
                    beside["paired_copy"] = self.paired_copy()
                self.barrier()
                t0 = now()
                fut = ckpt.save_async(state, step=step)
                t1 = now()
                info = fut.wait()
                t2 = now()
                if paired and not write_first:
                    beside["paired_write"] = self.paired_write()
                rec = {"t0": t0, "blocked_s": t1 - t0, "staged_s": info.staged_s,
                       "durable_s": t2 - t0, "t_end": t2, "info_blocked_s": info.blocked_s,
                       "info_durable_s": info.durable_s, "bytes": info.bytes, **beside}
                if step == 0:
                    out["first"] = rec
                else:
                    out["saves"].append(rec)
                self.log(f"asyncckpt save {step}: blocked {rec['blocked_s']:.3f}s staged "
                         f"{rec['staged_s']:.3f}s durable {rec['durable_s']:.3f}s")
                del fut
        finally:
            ckpt.close()
        if self.repeats >= 1:
            self.remove(root / f"step_{self.repeats - 1:09d}")
        del ckpt
        bc.free_memory()
        # a fresh checkpointer (and arena) whose prepare() ran ahead of its first save
        proot = self.work / "asyncckpt_prepared"
        ckpt = asyncckpt.AsyncCheckpointer(proot, mode="async", timeout_s=self.spec["timeout_s"])
        try:
            t0 = now()
            ckpt.prepare(state).result()
            prepare_s = now() - t0
            self.barrier()
            t0 = now()
            fut = ckpt.save_async(state, step=0)
            t1 = now()
            info = fut.wait()
            t2 = now()
            out["first_prepared"] = {"t0": t0, "blocked_s": t1 - t0, "staged_s": info.staged_s,
                                     "durable_s": t2 - t0, "t_end": t2,
                                     "prepare_s": prepare_s, "bytes": info.bytes}
            self.log(f"asyncckpt first save after prepare() ({prepare_s:.3f}s): blocked "
                     f"{t1 - t0:.3f}s durable {t2 - t0:.3f}s")
            del fut
        finally:
            ckpt.close()
        del ckpt
        self.remove(proot)
        return out

    def dcp_options(self) -> tuple[Any, str]:
        from torch.distributed.checkpoint.staging import StagingOptions

        accel = torch.cuda.is_available()
        options = StagingOptions(use_pinned_memory=accel, use_shared_memory=True,
                                 use_async_staging=True, use_non_blocking_copy=accel)
        return options, (f"DefaultStager({options}) reused; FileSystemWriter("
                         f"single_file_per_rank=True, sync_files=True, thread_count="
                         f"{self.spec['dcp_threads']}); async_save on a dedicated gloo group "
                         "(thread executor); load = dcp.load in place on that group")

    def dcp_saves(self, state: Any) -> tuple[dict[str, Any], Path, Any]:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        pg = dist.new_group(backend="gloo")  # DCP's background collectives stay off the default
        options, note = self.dcp_options()
        stager = DefaultStager(options)
        root = self.work / "dcp"
        out: dict[str, Any] = {"saves": [], "options": note}
        path = root
        try:
            for step in range(self.repeats + 1):
                if step >= 2:
                    self.remove(root / f"step_{step - 2}")
                path = root / f"step_{step}"
                writer = dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True,
                                              thread_count=self.spec["dcp_threads"])
                self.barrier()
                with bc._quiet_dcp():
                    t0 = now()
                    resp = dcp.async_save(state, storage_writer=writer, async_stager=stager,
                                          process_group=pg)
                    t1 = now()
                    if isinstance(resp, AsyncSaveResponse):
                        resp.staging_completion.result()
                        ts = now()
                        resp.upload_completion.result()
                    else:
                        ts = t1
                        resp.result()
                    t2 = now()
                rec = {"t0": t0, "blocked_s": t1 - t0, "staged_s": ts - t0, "durable_s": t2 - t0,
                       "t_end": t2}
                if step == 0:
                    out["first"] = rec
                else:
                    out["saves"].append(rec)
                self.log(f"DCP save {step}: blocked {rec['blocked_s']:.3f}s staged "
                         f"{rec['staged_s']:.3f}s durable {rec['durable_s']:.3f}s")
                del resp
        finally:
            stager.close()
        return out, path, pg

    def dcp_load(self, tree: Any, path: Path, pg: Any) -> None:
        import torch.distributed.checkpoint as dcp

        with bc._quiet_dcp():
            dcp.load(tree, checkpoint_id=path, process_group=pg)

    def loads(self, lib: str, state: Any, load: Callable[[Any], Any], where: Path
              ) -> dict[str, Any]:
        """(a) into ``state`` (Shard(0), as saved), (b) into a fresh Shard(1) tree; each
        ``repeats`` times cold, then hot."""
        out: dict[str, Any] = {}
        target1 = None
        for case in ("same_shard0", "reshard_shard1"):
            if case == "reshard_shard1":
                target1 = self.build_target_shard1()
            tree = state if case == "same_shard0" else target1
            recs: dict[str, list[dict[str, Any]]] = {"cold": [], "hot": []}
            for _ in range(self.repeats):
                for temp in ("cold", "hot"):
                    drop = self.drop(where) if temp == "cold" else {}
                    resident = lim.residency(where) if temp == "hot" else None
                    self.barrier()
                    with self.probed(tree, f"{lib} {case} {temp}"):
                        t0 = now()
                        load(tree)
                        t1 = now()
                    recs[temp].append({"t0": t0, "t1": t1, "load_s": t1 - t0, **drop,
                                       **({"residency_before": resident} if resident is not None
                                          else {})})
                self.log(f"{lib} load {case}: cold {recs['cold'][-1]['load_s']:.3f}s hot "
                         f"{recs['hot'][-1]['load_s']:.3f}s")
            out[case] = recs
            del tree
        del target1
        return out


def rank_main(spec_path: str) -> None:
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    rank, world = spec["rank"], spec["world"]
    # Print every thread's stack a little before the parent's hard timeout kills us.
    faulthandler.dump_traceback_later(max(10.0, spec["timeout_s"] - 10.0), exit=True)
    torch.set_num_threads(1)  # N ranks on a machine of N cores
    code = 0
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world,
            timeout=dt.timedelta(seconds=min(spec["timeout_s"], 600)))
        result = RankBench(spec).run()
        tmp = Path(spec["work"]) / f"result_{rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(Path(spec["work"]) / f"result_{rank}.json")
        dist.barrier()  # rank 0 hosts the Store: nobody leaves before everyone is done
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: a library's threads may still wait on a dead peer


# --- turning the raw records into numbers, targets and tables ------------------------------


def _span(events: Sequence[dict[str, Any]], start: str = "t0", end: str = "t1") -> float:
    """Global time of one event seen by every rank: latest end minus earliest start."""
    return max(e[end] for e in events) - min(e[start] for e in events)


def summarize(res: dict[str, Any]) -> None:
    """Per-rank lists and medians, and global (over-the-ranks) times, into ``res``."""
    ranks: dict[int, dict[str, Any]] = res["ranks"]
    world = res["world"]
    rk = range(world)
    lim_r = {r: ranks[r]["limits"] for r in rk}
    limits = res["limits"]
    # The copy limit is the candidate whose all-ranks-at-once copy ends soonest.
    by_method = {m: [_span([lim_r[r]["copy_by_method"][m][i] for r in rk])
                     for i in range(res["repeats"])]
                 for m in lim_r[0]["copy_by_method"]}
    best = min(by_method, key=lambda m: median(by_method[m]))
    limits["copy_global_by_method_s"] = by_method
    limits["copy_method"] = best
    limits["copy_s"] = {r: [e["t1"] - e["t0"] for e in lim_r[r]["copy_by_method"][best]]
                        for r in rk}
    limits["copy_global_s"] = by_method[best]
    limits["odirect_part_s"] = {r: [e["t1"] - e["t0"] for e in lim_r[r]["odirect_part"]]
                                for r in rk}
    limits["odirect_parts_global_s"] = [_span([lim_r[r]["odirect_part"][i] for r in rk])
                                        for i in range(res["repeats"])]
    limits["part_bytes"] = [lim_r[r]["bytes"] for r in rk]
    saves: dict[str, Any] = {}
    for label, key in (("asyncckpt async", "asyncckpt"), ("DCP async_save", "dcp")):
        per = {r: ranks[r][key] for r in rk}
        s: dict[str, Any] = {"ranks": {}}
        for r in rk:
            s["ranks"][r] = {k: [x[k] for x in per[r]["saves"]]
                             for k in ("blocked_s", "staged_s", "durable_s")}
            s["ranks"][r]["first"] = {k: per[r]["first"][k]
                                      for k in ("blocked_s", "staged_s", "durable_s")}
            if "first_prepared" in per[r]:
                s["ranks"][r]["first_prepared"] = {
                    k: per[r]["first_prepared"][k]
                    for k in ("blocked_s", "staged_s", "durable_s", "prepare_s")}
        s["global_durable_s"] = [_span([per[r]["saves"][i] for r in rk], end="t_end")
                                 for i in range(res["repeats"])]
        s["global_first_durable_s"] = _span([per[r]["first"] for r in rk], end="t_end")
        if all("first_prepared" in per[r] for r in rk):
            s["global_first_prepared_durable_s"] = _span(
                [per[r]["first_prepared"] for r in rk], end="t_end")
        if "options" in per[0]:
            s["options"] = per[0]["options"]
        if all("paired_write" in x for r in rk for x in per[r]["saves"]):
            s["paired_copy_s"] = {r: [x["paired_copy"][best]["t1"] - x["paired_copy"][best]["t0"]
                                      for x in per[r]["saves"]] for r in rk}
            s["paired_write_global_s"] = [_span([per[r]["saves"][i]["paired_write"] for r in rk])
                                          for i in range(res["repeats"])]
        saves[label] = s
    res["saves"] = saves
    loads: dict[str, Any] = {}
    for lib, key in (("asyncckpt", "asyncckpt_loads"), ("DCP", "dcp_loads")):
        loads[lib] = {}
        for case in ("same_shard0", "reshard_shard1"):
            c: dict[str, Any] = {}
            for temp in ("cold", "hot"):
                recs = {r: ranks[r][key][case][temp] for r in rk}
                c[f"{temp}_s"] = {r: [x["load_s"] for x in recs[r]] for r in rk}
                c[f"{temp}_global_s"] = [_span([recs[r][i] for r in rk])
                                         for i in range(res["repeats"])]
                if temp == "cold":
                    c["cold_residency_after_drop"] = [x.get("residency_after")
                                                      for x in recs[0]]
                    c["cold_drop"] = [x.get("method") for x in recs[0]]
                else:
                    c["hot_residency"] = [x.get("residency_before") for x in recs[0]]
            loads[lib][case] = c
    loads["asyncckpt"]["whole_one_process"] = res["whole"]
    res["loads"] = loads
    res["checked"] = {r: ranks[r]["checked"] for r in rk}
    res["checked"]["whole_one_process"] = res["whole"]["checked_tensors"]


def evaluate(res: dict[str, Any]) -> list[bc.Target]:
    world = res["world"]
    limits = res["limits"]
    write_s = median(limits["odirect_write_s"])
    out: list[bc.Target] = []

    def add(name: str, value: float, bound: float, factor: float) -> None:
        r = bc.ratio(value, bound)
        thr = "n/a" if math.isnan(bound) else f"≤ {factor:g}x {bc.fmt_s(bound)}"
        out.append(bc.Target(name, bc.fmt_s(value), thr, r, None if math.isnan(r) else r <= factor))

    ours = res["saves"]["asyncckpt async"]
    dcp = res["saves"]["DCP async_save"]
    def add_paired(name: str, values: list[float], limits_beside: list[float],
                   factor: float, what: str) -> None:
        """A target on the median of the per-save ratios to the limit measured beside."""
        r = median([bc.ratio(v, b) for v, b in zip(values, limits_beside, strict=True)])
        out.append(bc.Target(name, bc.fmt_s(median(values)),
                             f"≤ {factor:g}x {what} (beside each save, median "
                             f"{bc.fmt_s(median(limits_beside))})", r,
                             None if math.isnan(r) else r <= factor))

    paired = "paired_write_global_s" in ours
    for r in range(world):
        name = f"rank {r} blocked ≤ 1.1x its copy limit (async)"
        if paired:
            add_paired(name, ours["ranks"][r]["blocked_s"], ours["paired_copy_s"][r], 1.1,
                       "its copy")
        else:
            add(name, median(ours["ranks"][r]["blocked_s"]), median(limits["copy_s"][r]), 1.1)
    name = "global durable ≤ 1.15x O_DIRECT write of the whole checkpoint (async)"
    if paired:
        add_paired(name, ours["global_durable_s"], ours["paired_write_global_s"], 1.15,
                   f"the {world} ranks' O_DIRECT writes of their parts at once")
    else:
        add(name, median(ours["global_durable_s"]), write_s, 1.15)

    def worst(s: dict[str, Any], key: str) -> float:
        return max(median(s["ranks"][r][key]) for r in range(world))

    add("ahead of DCP: blocked (slowest rank) vs DCP staged", worst(ours, "blocked_s"),
        worst(dcp, "staged_s"), 1.0)
    add("ahead of DCP: staged (slowest rank)", worst(ours, "staged_s"), worst(dcp, "staged_s"),
        1.0)
    add("ahead of DCP: global durable", median(ours["global_durable_s"]),
        median(dcp["global_durable_s"]), 1.0)
    add("ahead of DCP: first save, global durable", ours["global_first_durable_s"],
        dcp["global_first_durable_s"], 1.0)
    for case, what in (("same_shard0", "load into Shard(0)"),
                       ("reshard_shard1", "resharding load into Shard(1)")):
        for temp in ("cold", "hot"):
            add(f"ahead of DCP: {what}, {temp} (global)",
                median(res["loads"]["asyncckpt"][case][f"{temp}_global_s"]),
                median(res["loads"]["DCP"][case][f"{temp}_global_s"]), 1.0)
    return out


def render(res: dict[str, Any]) -> str:
    """The section's markdown: limits, saves, loads, targets."""
    world = res["world"]
    rk = range(world)
    n = res["repeats"]
    total = res["state_bytes"]
    rb = res["rank_bytes"]
    limits = res["limits"]
    fmt_s, fmt_x, ratio = bc.fmt_s, bc.fmt_x, bc.ratio

    def gbps(nbytes: float, s: float) -> str:
        return bc.fmt_gbps(int(nbytes), s)

    write_s = median(limits["odirect_write_s"])
    part_s = median(limits["odirect_parts_global_s"])
    copy_s = {r: median(limits["copy_s"][r]) for r in rk}
    parts = [f"### World size {world}: each rank 1/{world} of the state (median of {n})", "",
             f"{world} rank processes (gloo on 127.0.0.1, 1 torch thread each) hold "
             f"{total / GiB:.3f} GiB ({total / GB:.3f} GB) in {res['tensors']} tensors as "
             f"DTensors: Shard(0) over a 1-D CPU mesh of {world} (0-d `step` scalars "
             "Replicate()); per rank " + ", ".join(f"{b / GiB:.3f} GiB" for b in rb)
             + ". Global times are the latest end over the ranks minus the earliest start "
             "(every timed event starts right after a barrier).", ""]
    rows = [[f"copy into a pre-touched buffer ({limits['copy_method']}), all ranks at once",
             *[f"{fmt_s(copy_s[r])} ({gbps(rb[r], copy_s[r])} GB/s)" for r in rk],
             fmt_s(median(limits["copy_global_s"])), "fastest: **the per-rank copy limit**"],
            *[[f"copy into a pre-touched buffer ({m}), all ranks at once", *["" for _ in rk],
               fmt_s(median(v)), "slower"]
              for m, v in limits["copy_global_by_method_s"].items()
              if m != limits["copy_method"]],
            ["O_DIRECT write + fsync of the whole checkpoint, one stream (this process)",
             *["" for _ in rk], f"{fmt_s(write_s)} ({gbps(total, write_s)} GB/s)",
             "**the disk limit**" + ("" if limits.get("odirect") else " (O_DIRECT refused)")],
            [f"O_DIRECT write + fsync, each rank its {1 / world:.2g} at once (reference)",
             *[fmt_s(median(limits["odirect_part_s"][r])) for r in rk],
             f"{fmt_s(part_s)} ({gbps(sum(limits['part_bytes']), part_s)} GB/s)", ""],
            ["cold sequential read of the whole, 8 MiB preads (reference)", *["" for _ in rk],
             f"{fmt_s(median(limits['cold_read_s']))} "
             f"({gbps(total, median(limits['cold_read_s']))} GB/s)",
             f"page cache dropped by {limits['cold_drop'][-1]}"]]
    parts += ["#### Limits", "", bc.table(["limit", *[f"rank {r}" for r in rk], "global",
                                            "notes"], rows), ""]
    rows = []
    for label, s in res["saves"].items():
        for r in rk:
            m = s["ranks"][r]
            first = m["first"]
            fp = m.get("first_prepared")
            b = median(m["blocked_s"])
            rows.append([label, f"rank {r}", fmt_s(b), fmt_s(median(m["staged_s"])),
                         fmt_s(median(m["durable_s"])),
                         f"{fmt_s(first['blocked_s'])} / {fmt_s(first['durable_s'])}",
                         f"{fmt_s(fp['blocked_s'])} / {fmt_s(fp['durable_s'])}" if fp else "n/a",
                         fmt_x(ratio(b, copy_s[r])), ""])
        g = median(s["global_durable_s"])
        gp = s.get("global_first_prepared_durable_s")
        rows.append([label, "**global commit**", "", "", f"**{fmt_s(g)}** "
                     f"({gbps(total, g)} GB/s)", f"— / {fmt_s(s['global_first_durable_s'])}",
                     f"— / {fmt_s(gp)}" if gp is not None else "n/a", "",
                     fmt_x(ratio(g, write_s))])
    parts += [f"#### Saves (median of {n}; first save apart)", "",
              bc.table(["method", "rank", "blocked", "staged", "durable",
                        "first save blocked / durable",
                        "first save after prepare() blocked / durable",
                        "blocked / copy limit", "durable / disk limit"], rows), ""]
    notes = []
    a = res["saves"]["asyncckpt async"]
    prep = [a["ranks"][r].get("first_prepared", {}).get("prepare_s") for r in rk]
    if all(p is not None for p in prep):
        notes.append("- asyncckpt async: `AsyncCheckpointer(mode=\"async\")`; prepare() took "
                     + ", ".join(f"{fmt_s(p)}" for p in prep) + " (ranks 0..), before the "
                     "barrier of the save it prepares")
    if "options" in res["saves"]["DCP async_save"]:
        notes.append(f"- DCP async_save: {res['saves']['DCP async_save']['options']}")
    d = res["saves"]["DCP async_save"]
    notes.append(f"- global commit / the {world}-stream O_DIRECT reference: asyncckpt "
                 f"{fmt_x(ratio(median(a['global_durable_s']), part_s))}, DCP "
                 f"{fmt_x(ratio(median(d['global_durable_s']), part_s))}")
    def per_save(values: list[float], beside: list[float]) -> float:
        return median([ratio(v, b) for v, b in zip(values, beside, strict=True)])

    if "paired_write_global_s" in a:
        pc, pw = a["paired_copy_s"], a["paired_write_global_s"]
        notes.append(
            "- limits beside each asyncckpt save (the disk of this VM drifts 2-4x within "
            "minutes): the copy right before it, all ranks at once, "
            + ", ".join(f"rank {r} {fmt_s(median(pc[r]))}" for r in rk)
            + f"; the {world} ranks' O_DIRECT writes of their parts at once, after the save or "
            f"before it (alternating), {fmt_s(median(pw))} "
            f"({gbps(sum(limits['part_bytes']), median(pw))} GB/s). Per-save ratios, median: "
            + ", ".join(f"rank {r} blocked / copy "
                        f"{fmt_x(per_save(a['ranks'][r]['blocked_s'], pc[r]))}" for r in rk)
            + f", global durable / write {fmt_x(per_save(a['global_durable_s'], pw))} (the "
            "targets use these)")
    parts += [*notes, ""]
    rows = []
    cases = (("(a) same layout, Shard(0)", "same_shard0"),
             ("(b) resharded into Shard(1)", "reshard_shard1"))
    read_s = median(limits["cold_read_s"])
    for what, case in cases:
        for lib in ("asyncckpt", "DCP"):
            c = res["loads"][lib][case]
            for temp in ("cold", "hot"):
                g = median(c[f"{temp}_global_s"])
                rows.append([what, lib, temp, *[fmt_s(median(c[f"{temp}_s"][r])) for r in rk],
                             fmt_s(g), gbps(total, g),
                             fmt_x(ratio(read_s, g)) if temp == "cold" else ""])
    w = res["loads"]["asyncckpt"]["whole_one_process"]
    for temp in ("cold", "hot"):
        g = median(w[f"{temp}_s"])
        rows.append(["(c) whole, one process: asyncckpt.load(dir)", "asyncckpt", temp,
                     *["" for _ in rk], fmt_s(g), gbps(total, g),
                     fmt_x(ratio(read_s, g)) if temp == "cold" else ""])
    parts += [f"#### Loads of the {world}-rank checkpoint (median of {n})", "",
              bc.table(["load", "method", "cache", *[f"rank {r}" for r in rk],
                        "global", "GB/s", "BW / cold read BW"], rows), ""]
    res_notes = []
    for lib in ("asyncckpt", "DCP"):
        for _, case in cases:
            c = res["loads"][lib][case]
            after = [x for x in c["cold_residency_after_drop"] if x is not None]
            if after and max(after) > 0.01:
                res_notes.append(f"- {lib} {case}: cold loads started with up to "
                                 f"{max(after):.1%} of the files cached")
            hot = [x for x in c["hot_residency"] if x is not None]
            if hot and min(hot) < 0.99:
                res_notes.append(f"- {lib} {case}: hot loads started with only {min(hot):.1%} "
                                 "cached")
    checked = res["checked"]
    res_notes.append("- every load zeroed a few tensors' local shards first and checked them "
                     "against the seeded originals afterwards (" + ", ".join(
                         f"rank {r}: {sum(checked[r].values())}" for r in rk)
                     + f", whole: {checked['whole_one_process']} tensor checks); asyncckpt "
                     "also verifies its checksums, DCP has none")
    parts += [*res_notes, ""]
    parts += [f"#### Targets (world size {world})", "",
              bc.table(["target", "measured", "threshold", "ratio", "verdict"],
                       [[t["name"], t["measured"], t["threshold"], fmt_x(t["ratio"]),
                         t["verdict"]] for t in res["targets"]]), ""]
    mem = res["memory"]
    parts.append(f"Dist section: peak machine memory in use "
                 f"{mem['peak_extra_used_bytes'] / GiB:.2f} GiB above the "
                 f"{mem['baseline_used_bytes'] / GiB:.2f} GiB before it (page cache not "
                 "counted, shared memory counted); rank peak RSS "
                 + ", ".join(f"{b / GiB:.2f} GiB" for b in mem["rank_peak_rss_bytes"])
                 + f"; wall time {res.get('wall_s', 0):.0f} s.")
    return "\n".join(parts)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-worker":
        rank_main(sys.argv[2])
    else:
        raise SystemExit(bc.main(["--only", "dist", *sys.argv[1:]]))
