"""Benchmark asyncckpt against the machine's limits and against the usual anchors.

One run, one state (by default ~3 GiB: a 1 GiB fp32 GPT-like "model" of ~1,000 tensors
plus its AdamW moments), measured in this order:

* memory   -- extra RSS and blocked time across consecutive async saves (run first,
              before other sections leave freed memory in the heap);
* limits   -- copy into a pre-touched buffer, O_DIRECT write + fsync (and ``dd`` for
              reference), cold and hot sequential reads;
* asyncckpt -- modes sync, async, async_pinned, and async with ``overlap=True``;
* torch_save, safetensors, dcp -- the anchors (DCP: ``async_save`` with a reused
              ``DefaultStager``); with safetensors, its files loaded by
              ``asyncckpt.load_safetensors`` too;
* dist     -- ``--world`` (2) rank processes, each holding its share of the same state as
              DTensors, asyncckpt against DCP: see ``bench_dist.py`` (run first, before this
              process builds its state, so that the ranks have the memory);
* peer     -- a recovering worker receiving the state from a serving process over
              127.0.0.1, beside raw TCP and torchft's HTTPTransport: see ``bench_peer.py``
              (also run before this process builds its state).

Every save reports blocked (until the call returned), staged (until the tensors were
copied and may be mutated) and durable (until everything was fsync'd) seconds; every
checkpoint is then loaded in place twice: cold (page cache of its files dropped) and
hot. Medians of ``--repeats`` runs are printed as markdown tables, with ratios to the
limits and a PASS/MISS verdict per target. ``--json`` writes every raw number.

Usage:
    python benchmarks/bench_checkpoint.py                 # full run, ~3 GiB state
    python benchmarks/bench_checkpoint.py --quick         # smoke test, ~64 MiB state
    python benchmarks/bench_checkpoint.py --only limits,asyncckpt --json out.json
    python benchmarks/bench_checkpoint.py --only dist --world 2   # the 2-rank section alone
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

import _limits as lim
import asyncckpt

SECTIONS = ("limits", "asyncckpt", "torch_save", "safetensors", "dcp", "memory", "dist", "peer")
RUN_ORDER = ("memory", "limits", "asyncckpt", "torch_save", "safetensors", "dcp")
ASYNCCKPT_MODES: tuple[tuple[str, str, bool], ...] = (
    # (label, mode, overlap)
    ("asyncckpt sync", "sync", False),
    ("asyncckpt async", "async", False),
    ("asyncckpt async_pinned", "async_pinned", False),
    ("asyncckpt async overlap", "async", True),
)
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "bench-out"
GB = 1e9
GiB = 2**30
MiB = 2**20

State = dict[str, Any]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def free_memory() -> None:
    gc.collect()
    lim.malloc_trim()


# --- the state -----------------------------------------------------------------------------


def model_shapes(total: int, n_tensors: int) -> dict[str, tuple[int, ...]]:
    """GPT-like parameter shapes: ~``n_tensors`` tensors of exactly ``total`` elements.

    Layers of 12 tensors (two norms, fused qkv, attention projection, a 4x MLP, with
    biases); the token embedding takes whatever is left, so that the sum is exact.
    """
    layers = max(1, (n_tensors - 4) // 12)
    d = max(32, int(math.sqrt(0.95 * total / (12 * layers))) // 32 * 32)
    positions = max(1, min(1024, total // (100 * d)))
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (0,), "pos_emb.weight": (positions, d)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({
            p + "ln1.weight": (d,), p + "ln1.bias": (d,),
            p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
            p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,),
            p + "ln2.weight": (d,), p + "ln2.bias": (d,),
            p + "mlp.fc1.weight": (4 * d, d), p + "mlp.fc1.bias": (4 * d,),
            p + "mlp.fc2.weight": (d, 4 * d), p + "mlp.fc2.bias": (d,),
        })
    shapes["ln_f.weight"] = (d,)
    shapes["ln_f.bias"] = (d,)
    rest = total - sum(math.prod(s) for s in shapes.values())
    if rest < d:
        raise ValueError(f"{total} elements are too few for {n_tensors} tensors")
    vocab, tail = divmod(rest, d)
    shapes["tok_emb.weight"] = (vocab, d)
    if tail:
        shapes["lm_head.bias"] = (tail,)
    return shapes


def build_state(model_floats: int, n_tensors: int, seed: int = 0) -> State:
    """{"model": {name: fp32}, "optim": {"state": {i: {step, exp_avg, exp_avg_sq}}}}."""
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    optim: dict[int, dict[str, torch.Tensor]] = {}
    for i, (name, shape) in enumerate(model_shapes(model_floats, n_tensors).items()):
        model[name] = torch.randn(shape, generator=gen)
        optim[i] = {
            "step": torch.tensor(float(1000 + i)),
            "exp_avg": torch.randn(shape, generator=gen).mul_(1e-3),
            "exp_avg_sq": torch.rand(shape, generator=gen).mul_(1e-6),
        }
    return {"model": model, "optim": {"state": optim}}


def named_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor of a nested dict, in insertion order."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
        return
    for k, v in tree.items():
        yield from named_tensors(v, f"{prefix}/{k}" if prefix else str(k))


def copy_tree(dst: Any, src: Any) -> None:
    """Copy the tensors of ``src`` into the same-shaped tree ``dst`` in place."""
    with torch.no_grad():
        for k, v in dst.items():
            if isinstance(v, torch.Tensor):
                v.copy_(src[k])
            else:
                copy_tree(v, src[k])


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for _, t in named_tensors(state))


# --- methods: one save / load protocol for the library and every anchor ---------------------


@dataclass
class SaveTiming:
    blocked_s: float
    staged_s: float
    durable_s: float
    path: Path  # what to load from and drop from the page cache


class Method(Protocol):
    name: str
    notes: list[str]

    def save(self, step: int) -> SaveTiming: ...

    def load(self, path: Path) -> None: ...

    def close(self) -> None: ...


@dataclass
class MethodResult:
    name: str
    blocked_s: list[float] = field(default_factory=list)
    staged_s: list[float] = field(default_factory=list)
    durable_s: list[float] = field(default_factory=list)
    load_cold_s: list[float] = field(default_factory=list)
    load_hot_s: list[float] = field(default_factory=list)
    first: dict[str, float] = field(default_factory=dict)
    cold_drop: list[str] = field(default_factory=list)
    cold_residency: list[float] = field(default_factory=list)
    hot_residency: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # the limits measured beside each save (PairedLimits); empty without the limits section
    paired_copy_s: list[float] = field(default_factory=list)
    paired_write_s: list[float] = field(default_factory=list)
    paired_read_s: list[float] = field(default_factory=list)

    def med(self, key: str) -> float:
        values: list[float] = getattr(self, key)
        return median(values)

    def paired(self, key: str, limit: str, *, bandwidth: bool = False) -> float:
        """The median over the saves of ``key`` / the limit measured beside it (for
        ``bandwidth``, the limit's time / ``key``: a bandwidth ratio)."""
        pairs = list(zip(getattr(self, key), getattr(self, limit), strict=False))
        if not pairs:
            return math.nan
        return median([ratio(b, a) if bandwidth else ratio(a, b) for a, b in pairs])

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["median"] = {k: self.med(k) for k in
                       ("blocked_s", "staged_s", "durable_s", "load_cold_s", "load_hot_s")}
        d["paired_ratio"] = {
            "blocked_copy": self.paired("blocked_s", "paired_copy_s"),
            "durable_write": self.paired("durable_s", "paired_write_s"),
            "hot_load_copy": self.paired("load_hot_s", "paired_copy_s"),
            "cold_load_read_bw": self.paired("load_cold_s", "paired_read_s", bandwidth=True)}
        return d


class LoadProbe:
    """Zeroes a few tensors of the state before a load and checks the load restored them."""

    def __init__(self, state: State):
        tensors = list(named_tensors(state))
        picks = {0, len(tensors) // 2, len(tensors) - 1}
        self.probes = [(tensors[i][0], tensors[i][1], tensors[i][1].clone()) for i in picks]

    @contextlib.contextmanager
    def check(self, who: str) -> Iterator[None]:
        with torch.no_grad():
            for _, t, _ in self.probes:
                t.zero_()
        yield
        for name, t, want in self.probes:
            if not torch.equal(t, want):
                raise RuntimeError(f"{who}: loading did not restore {name} in place")


def run_method(method: Method, state: State, repeats: int, *, first_save: bool,
               paired: PairedLimits | None = None) -> MethodResult:
    """Save ``repeats`` times (after one reported-apart first save when ``first_save``);
    after each save load cold, then hot, then delete the checkpoint. With ``paired``, the
    limits are measured again beside every save (see PairedLimits)."""
    res = MethodResult(method.name)
    probe = LoadProbe(state)
    step = 0
    if first_save:
        t = method.save(step)
        res.first = {"blocked_s": t.blocked_s, "staged_s": t.staged_s, "durable_s": t.durable_s}
        log(f"{method.name}: first save blocked {t.blocked_s:.3f}s durable {t.durable_s:.3f}s")
        _remove(t.path)
        step += 1
    for r in range(repeats):
        limit_first = r % 2 == 1  # alternate: see PairedLimits
        if paired and limit_first:
            _limit_round(paired, res)
        if paired:
            res.paired_copy_s.append(paired.copy())
        t = method.save(step)
        step += 1
        res.blocked_s.append(t.blocked_s)
        res.staged_s.append(t.staged_s)
        res.durable_s.append(t.durable_s)
        if not res.first:
            res.first = {"blocked_s": t.blocked_s, "staged_s": t.staged_s,
                         "durable_s": t.durable_s}
        drop = lim.drop_cache(t.path)
        res.cold_drop.append(drop.method)
        res.cold_residency.append(drop.residency_after)
        with probe.check(f"{method.name} cold"):
            t0 = time.perf_counter()
            method.load(t.path)
            res.load_cold_s.append(time.perf_counter() - t0)
        res.hot_residency.append(lim.residency(t.path))
        with probe.check(f"{method.name} hot"):
            t0 = time.perf_counter()
            method.load(t.path)
            res.load_hot_s.append(time.perf_counter() - t0)
        log(f"{method.name} {r + 1}/{repeats}: blocked {t.blocked_s:.3f}s staged "
            f"{t.staged_s:.3f}s durable {t.durable_s:.3f}s | load cold "
            f"{res.load_cold_s[-1]:.3f}s hot {res.load_hot_s[-1]:.3f}s"
            + (f" | copy beside it {res.paired_copy_s[-1]:.3f}s" if paired else ""))
        _remove(t.path)
        if paired and not limit_first:
            _limit_round(paired, res)
    res.notes = list(method.notes)
    if res.cold_residency and max(res.cold_residency) > 0.01:
        res.notes.append(f"cold loads started with up to {max(res.cold_residency):.1%} of the "
                         "files still cached")
    if res.hot_residency and min(res.hot_residency) < 0.99:
        res.notes.append(f"hot loads started with only {min(res.hot_residency):.1%} of the "
                         "files cached")
    return res


def _limit_round(paired: PairedLimits, res: MethodResult) -> None:
    w, rd = paired.write_then_read()
    res.paired_write_s.append(w)
    res.paired_read_s.append(rd)
    log(f"{res.name}: limit round beside save {len(res.paired_write_s)}: O_DIRECT write "
        f"{w:.3f}s, then its cold read {rd:.3f}s")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class AsyncckptMethod:
    def __init__(self, name: str, root: Path, state: State, mode: str, overlap: bool):
        self.name = name
        self.state = state
        self.overlap = overlap
        self.ckpt = asyncckpt.AsyncCheckpointer(root, mode=mode)
        self.notes: list[str] = []
        if mode == "async_pinned" and not torch.cuda.is_available():
            self.notes.append("no CUDA: the arena is not pinned, same as async")

    def save(self, step: int) -> SaveTiming:
        t0 = time.perf_counter()
        fut = self.ckpt.save_async(self.state, step=step, overlap=self.overlap)
        blocked = time.perf_counter() - t0
        if self.overlap:
            fut.wait_staged()
        info = fut.wait()
        durable = time.perf_counter() - t0
        return SaveTiming(blocked, info.staged_s, durable, info.path)

    def load(self, path: Path) -> None:
        asyncckpt.load(path, self.state)

    def close(self) -> None:
        self.ckpt.close()


class TorchSaveMethod:
    name = "torch.save"

    def __init__(self, root: Path, state: State):
        self.root = root
        self.state = state
        self.notes = ["blocked = staged = durable (synchronous); load = torch.load"
                      "(weights_only=True) + copy_ into the state"]

    def save(self, step: int) -> SaveTiming:
        path = self.root / f"step_{step}.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        s = time.perf_counter() - t0
        return SaveTiming(s, s, s, path)

    def load(self, path: Path) -> None:
        loaded = torch.load(path, weights_only=True)
        copy_tree(self.state, loaded)
        del loaded

    def close(self) -> None:
        pass


class SafetensorsMethod:
    name = "safetensors"

    def __init__(self, root: Path, state: State):
        self.root = root
        self.state = state
        self.flat = dict(named_tensors(state))
        self.notes = ["save_file + fsync; load = load_file + copy_ into the state"]

    def save(self, step: int) -> SaveTiming:
        from safetensors.torch import save_file

        path = self.root / f"step_{step}.safetensors"
        t0 = time.perf_counter()
        save_file(self.flat, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        s = time.perf_counter() - t0
        return SaveTiming(s, s, s, path)

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        loaded = load_file(path)
        with torch.no_grad():
            for k, t in self.flat.items():
                t.copy_(loaded[k])
        del loaded

    def close(self) -> None:
        pass


class SafetensorsImportMethod(SafetensorsMethod):
    """The safetensors anchor's files, loaded in place by ``asyncckpt.load_safetensors``
    (what a run starting from published weights does) rather than load_file + copy_."""

    name = "asyncckpt.load_safetensors"

    def __init__(self, root: Path, state: State):
        super().__init__(root, state)
        self.notes = ["save_file + fsync (as the safetensors anchor); load = "
                      "asyncckpt.load_safetensors in place (no checksums to check)"]

    def load(self, path: Path) -> None:
        asyncckpt.load_safetensors(path, self.state)


class DcpMethod:
    """``torch.distributed.checkpoint.async_save`` with one reused ``DefaultStager``.

    On a CPU-only machine the best options torch 2.13 allows are: async staging on the
    stager's thread (``use_async_staging``), shared-memory staging buffers cached across
    saves (``use_shared_memory``); pinned memory and non-blocking copies need an
    accelerator (pinning is ignored with a warning, non-blocking raises).
    """

    name = "DCP async_save"

    def __init__(self, root: Path, state: State, thread_count: int):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        accel = torch.cuda.is_available()
        self.options = StagingOptions(use_pinned_memory=accel, use_shared_memory=True,
                                      use_async_staging=True, use_non_blocking_copy=accel)
        self.stager = DefaultStager(self.options)
        self.root = root
        self.state = state
        self.thread_count = thread_count
        self.notes = [f"DefaultStager({self.options}) reused; FileSystemWriter(thread_count="
                      f"{thread_count}, sync_files=True); load = dcp.load in place"]

    def save(self, step: int) -> SaveTiming:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        path = self.root / f"step_{step}"
        writer = dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True,
                                      thread_count=self.thread_count)
        with _quiet_dcp():
            t0 = time.perf_counter()
            resp = dcp.async_save(self.state, storage_writer=writer, async_stager=self.stager,
                                  no_dist=True)
            blocked = time.perf_counter() - t0
            if isinstance(resp, AsyncSaveResponse):
                resp.staging_completion.result()
                staged = time.perf_counter() - t0
                resp.upload_completion.result()
            else:
                staged = blocked
                resp.result()
            durable = time.perf_counter() - t0
        return SaveTiming(blocked, staged, durable, path)

    def load(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        with _quiet_dcp():
            dcp.load(self.state, checkpoint_id=path, no_dist=True)

    def close(self) -> None:
        self.stager.close()


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# --- sections ------------------------------------------------------------------------------


@dataclass
class Context:
    state: State
    nbytes: int
    work: Path
    repeats: int
    saves: int
    dcp_threads: int
    paired: PairedLimits | None = None  # set by the limits section


class PairedLimits:
    """The machine's limits measured again beside every save and load.

    On this kind of VM the disk drifts 2-4x within minutes, and a read depends on what
    came just before it: the first read of a file written a moment ago is slow (0.5-1.3
    GB/s) while a second one, cache dropped, can run at 3 GB/s (the host caches it). So a
    ratio to a limit measured minutes earlier, or to a read of the files a load has just
    read, says more about the VM than about the method. Each save of every method is
    paired with a copy of the state into the pre-touched buffer right before it, and with
    a limit round that repeats the save-then-cold-load sequence with the simplest code:
    an O_DIRECT write + fsync of as many bytes, then a cold sequential read of that fresh
    file. The round goes after the method's save and loads in even repeats, before them
    in odd ones, so neither always follows the other's I/O.
    """

    def __init__(self, buf: lim.AlignedBuffer, copy: Callable[[], float], path: Path,
                 nbytes: int):
        self.buf = buf
        self._copy = copy
        self.path = path
        self.nbytes = nbytes

    def copy(self) -> float:
        self.buf.tensor.fill_(1)  # untimed: it is a copy into a pre-touched buffer
        return self._copy()

    def write_then_read(self) -> tuple[float, float]:
        """O_DIRECT write + fsync of the state's bytes to a new file, then a cold read of
        it; returns (write seconds, read seconds)."""
        mv = self.buf.memoryview()
        try:
            write_s = lim.odirect_write(self.path, mv, self.nbytes)[0]
            lim.drop_cache(self.path)
            read_s = lim.sequential_read(self.path, mv)[0]
        finally:
            del mv
            self.path.unlink(missing_ok=True)
        return write_s, read_s

    def close(self) -> None:
        self.buf.close()


def run_limits(ctx: Context) -> dict[str, Any]:
    tensors = [t for _, t in named_tensors(ctx.state)]
    out: dict[str, Any] = {"flat_copy_s": [], "odirect_write_s": [], "dd_write_s": [],
                           "dd_summary": [], "cold_read_s": [], "cold_read_2_s": [],
                           "cold_drop": [], "cold_residency": [], "hot_read_s": []}
    buf = lim.AlignedBuffer(lim.packed_nbytes(tensors))  # pre-touched
    views = buf.views_like(tensors)
    lim.copy_tensors(views, tensors)  # warm-up: thread pool, allocator, TLB
    # The copy limit is the fastest of the ways this machine has to copy these tensors:
    # torch's copy_ with its default intra-op threads (which can help or hurt: on small
    # VMs they hurt) or one thread, and libc memcpy split over threads. Rounds go
    # round-robin so that every candidate sees the same noise.
    candidates = copy_candidates(views, tensors)
    by_method: dict[str, list[float]] = {label: [] for label in candidates}
    for _ in range(ctx.repeats):
        for label, fn in candidates.items():
            by_method[label].append(fn())
    for label, v in by_method.items():
        log(f"limits: {label}: " + ", ".join(f"{s:.3f}s" for s in v))
    best = min(by_method, key=lambda k: median(by_method[k]))
    out["copy_s_by_method"] = by_method
    out["copy_method"] = best
    out["copy_s"] = by_method[best]
    other = lim.AlignedBuffer(buf.nbytes)
    lim.copy_tensors([other.tensor], [buf.tensor])
    for _ in range(ctx.repeats):
        out["flat_copy_s"].append(lim.copy_tensors([other.tensor], [buf.tensor]))
    other.close()
    del other
    free_memory()
    path = ctx.work / "limits.bin"
    mv = buf.memoryview()
    for r in range(ctx.repeats):
        w, direct = lim.odirect_write(path, mv, ctx.nbytes)
        out["odirect_write_s"].append(w)
        out["odirect"] = direct
        drop = lim.drop_cache(path)
        out["cold_drop"].append(drop.method)
        out["cold_residency"].append(drop.residency_after)
        rd, _ = lim.sequential_read(path, mv)
        out["cold_read_s"].append(rd)
        out["hot_read_s"].append(lim.sequential_read(path, mv)[0])
        lim.drop_cache(path)
        out["cold_read_2_s"].append(lim.parallel_read(path, mv, 2))
        log(f"limits: O_DIRECT write {r + 1}/{ctx.repeats}: {w:.3f}s; cold read {rd:.3f}s "
            f"({drop.method}, {drop.residency_after:.1%} left cached)")
        if r == ctx.repeats - 1:
            out["drop_methods"] = drop_methods_report(path, mv)
        path.unlink()
        try:
            d, summary = lim.dd_write(path, ctx.nbytes)
            out["dd_write_s"].append(d)
            out["dd_summary"].append(summary)
        except OSError as exc:  # no dd, or it failed: it is a reference only
            out["dd_summary"].append(f"dd failed: {exc}")
        path.unlink(missing_ok=True)
    del mv
    ctx.paired = PairedLimits(buf, candidates[best], ctx.work / "paired.bin", ctx.nbytes)
    out["dd_bytes"] = max(1, -(-ctx.nbytes // lim.PIECE_BYTES)) * lim.PIECE_BYTES
    out["median"] = {k: median(v) for k, v in out.items()
                     if k.endswith("_s") and isinstance(v, list)}
    return out


def copy_candidates(views: list[torch.Tensor], tensors: list[torch.Tensor]
                    ) -> dict[str, Callable[[], float]]:
    """Ways to copy ``tensors`` into the pre-touched ``views``, each returning seconds."""
    out: dict[str, Callable[[], float]] = {}
    for n in sorted({torch.get_num_threads(), 1}, reverse=True):
        def torch_copy(n: int = n) -> float:
            with lim.torch_threads(n):
                return lim.copy_tensors(views, tensors)
        out[f"torch copy_ per tensor, {n} thread{'s' if n > 1 else ''}"] = torch_copy
    k = max(2, min(4, os.cpu_count() or 1))
    out[f"memcpy per tensor, {k} threads"] = lambda: lim.memcpy_tensors(views, tensors, k)
    return out


def drop_methods_report(path: Path, mv: memoryview) -> dict[str, Any]:
    """Try both ways to drop a (fully cached) file's pages; report residency before/after."""
    report: dict[str, Any] = {}
    lim.sequential_read(path, mv)
    before = lim.cache_residency(path)
    lim.fadvise_dontneed(path)
    report["fadvise"] = {"before": before, "after": lim.cache_residency(path), "error": None}
    lim.sequential_read(path, mv)
    before = lim.cache_residency(path)
    err = lim.drop_all_caches()
    report["drop_caches"] = {"before": before, "after": lim.cache_residency(path), "error": err}
    return report


def run_asyncckpt(ctx: Context) -> dict[str, MethodResult]:
    out = {}
    for label, mode, overlap in ASYNCCKPT_MODES:
        root = ctx.work / label.replace(" ", "_")
        m = AsyncckptMethod(label, root, ctx.state, mode, overlap)
        try:
            out[label] = run_method(m, ctx.state, ctx.repeats, first_save=True,
                                    paired=ctx.paired)
        finally:
            m.close()
        shutil.rmtree(root, ignore_errors=True)
        free_memory()
    return out


def run_anchor(ctx: Context, make: Callable[[Path], Method], first_save: bool
               ) -> MethodResult:
    root = ctx.work / "anchor"
    root.mkdir(parents=True, exist_ok=True)
    m = make(root)
    try:
        return run_method(m, ctx.state, ctx.repeats, first_save=first_save,
                          paired=ctx.paired)
    finally:
        m.close()
        del m
        shutil.rmtree(root, ignore_errors=True)
        free_memory()


def run_memory(ctx: Context) -> dict[str, Any]:
    """Extra RSS and blocked time across ``ctx.saves`` async saves with keep_last=2."""
    free_memory()
    base = lim.rss_bytes()
    root = ctx.work / "memory"
    blocked: list[float] = []
    durable: list[float] = []
    extra_after: list[int] = []
    ckpt = asyncckpt.AsyncCheckpointer(root, mode="async", keep_last=2)
    try:
        # As the README advises: allocate the arena at start-up, not in the first save.
        t0 = time.perf_counter()
        ckpt.prepare(ctx.state, background=False)
        prepare_s = time.perf_counter() - t0
        log(f"memory: prepare() {prepare_s:.3f}s")
        with lim.RssSampler() as sampler:
            for i in range(ctx.saves):
                t0 = time.perf_counter()
                fut = ckpt.save_async(ctx.state, step=i)
                blocked.append(time.perf_counter() - t0)
                fut.wait()
                durable.append(time.perf_counter() - t0)
                extra_after.append(lim.rss_bytes() - base)
                log(f"memory: save {i + 1}/{ctx.saves}: blocked {blocked[-1]:.3f}s durable "
                    f"{durable[-1]:.3f}s extra RSS {extra_after[-1] / MiB:.0f} MiB")
        kept = len(ckpt.steps())
    finally:
        ckpt.close()
        del ckpt
    free_memory()
    after_close = lim.rss_bytes() - base
    shutil.rmtree(root, ignore_errors=True)
    max_extra = sampler.max_rss - base
    growth = max(extra_after) - extra_after[0]
    tolerance = max(0.02 * ctx.nbytes, 32 * MiB)
    later = blocked[1:]
    return {
        "saves": ctx.saves, "baseline_rss": base, "blocked_s": blocked, "durable_s": durable,
        "extra_after_save": extra_after, "first_extra": extra_after[0],
        "last_extra": extra_after[-1], "max_extra": max_extra, "growth": growth,
        "flat_tolerance": tolerance, "flat": growth <= tolerance,
        "extra_after_close": after_close, "kept_steps": kept,
        "first_blocked_s": blocked[0], "later_blocked_median_s": median(later),
        "prepare_s": prepare_s,
    }


# --- report --------------------------------------------------------------------------------


def fmt_s(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def fmt_gbps(nbytes: int, s: float) -> str:
    if math.isnan(s) or s <= 0:
        return "n/a"
    return f"{nbytes / s / GB:.2f}"


def fmt_x(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}x"


def ratio(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


@dataclass
class Target:
    name: str
    measured: str
    threshold: str
    ratio: float
    ok: bool | None  # None: not measured

    @property
    def verdict(self) -> str:
        return "n/a" if self.ok is None else ("PASS" if self.ok else "MISS")


def evaluate_targets(res: dict[str, Any], nbytes: int) -> list[Target]:
    methods: dict[str, MethodResult] = res.get("methods", {})
    mem = res.get("memory")
    limits = res.get("limits")
    lm = limits["median"] if limits else {}
    copy_s = lm.get("copy_s", math.nan)
    write_s = lm.get("odirect_write_s", math.nan)
    read_s = lm.get("cold_read_s", math.nan)
    out: list[Target] = []

    def add(name: str, value: float, bound: float, factor: float) -> None:
        """A time target: ``value <= factor * bound``."""
        r = ratio(value, bound)
        thr = "n/a" if math.isnan(bound) else f"≤ {factor:g}x {fmt_s(bound)}"
        out.append(Target(name, fmt_s(value), thr, r, None if math.isnan(r) else r <= factor))

    def med(label: str, key: str) -> float:
        m = methods.get(label)
        return m.med(key) if m else math.nan

    def add_limit(name: str, label: str, key: str, limit: str, global_s: float,
                  factor: float, what: str) -> None:
        """A target on the ratio to a limit: the one measured beside each save when the
        run has it (the median of the per-save ratios), else the limits section's."""
        m = methods.get(label)
        bw = limit == "paired_read_s"
        value = m.med(key) if m else math.nan
        measured = gbps(value) if bw else fmt_s(value)
        if m and getattr(m, limit):
            r = m.paired(key, limit, bandwidth=bw)
            limit_s = median(getattr(m, limit))
            where = "beside each save, median"
        else:
            limit_s = global_s
            r = ratio(global_s, value) if bw else ratio(value, global_s)
            where = "limits section"
        shown = gbps(limit_s) if bw else fmt_s(limit_s)
        thr = f"{'≥' if bw else '≤'} {factor:g}x {what} ({where} {shown})"
        ok = None if math.isnan(r) else (r >= factor if bw else r <= factor)
        out.append(Target(name, measured, thr, r, ok))

    def gbps(s: float) -> str:
        return "n/a" if math.isnan(s) else f"{nbytes / s / GB:.2f} GB/s"

    for label in ("asyncckpt async", "asyncckpt async_pinned"):
        add_limit(f"blocked ≤ 1.1x copy limit ({label.split()[-1]})", label, "blocked_s",
                  "paired_copy_s", copy_s, 1.1, "the copy")
    ov = med("asyncckpt async overlap", "blocked_s")
    out.append(Target("blocked ≤ 20 ms with overlap=True", fmt_s(ov), "≤ 20 ms",
                      ratio(ov, 0.020), None if math.isnan(ov) else ov <= 0.020))
    for label in ("asyncckpt async", "asyncckpt async_pinned", "asyncckpt async overlap"):
        add_limit(f"durable ≤ 1.15x O_DIRECT write ({label.removeprefix('asyncckpt ')})",
                  label, "durable_s", "paired_write_s", write_s, 1.15, "the O_DIRECT write")
    add_limit("hot in-place load ≤ 1.5x copy limit", "asyncckpt async", "load_hot_s",
              "paired_copy_s", copy_s, 1.5, "the copy")
    add_limit("cold load ≥ 0.9x cold read bandwidth", "asyncckpt async", "load_cold_s",
              "paired_read_s", read_s, 0.9, "the cold read")
    if mem:
        r = mem["max_extra"] / nbytes
        out.append(Target(f"extra RSS ≤ 1.1x state (max over {mem['saves']} saves)",
                          f"{mem['max_extra'] / GiB:.2f} GiB", f"≤ 1.1x {nbytes / GiB:.2f} GiB",
                          r, r <= 1.1))
        out.append(Target(f"extra RSS flat across {mem['saves']} saves",
                          f"+{mem['growth'] / MiB:.0f} MiB after save 1",
                          f"≤ {mem['flat_tolerance'] / MiB:.0f} MiB",
                          mem["growth"] / mem["flat_tolerance"], bool(mem["flat"])))
        r = ratio(mem["first_blocked_s"], mem["later_blocked_median_s"])
        out.append(Target("first save ≤ 2x a later one (blocked; prepare() at start-up)",
                          fmt_s(mem["first_blocked_s"]),
                          f"≤ 2x {fmt_s(mem['later_blocked_median_s'])}", r,
                          None if math.isnan(r) else r <= 2))
    first = methods.get("asyncckpt async")
    if first and first.first:
        r = ratio(first.first["blocked_s"], first.med("blocked_s"))
        out.append(Target("first save ≤ 2x a later one (blocked; no prepare())",
                          fmt_s(first.first["blocked_s"]),
                          f"≤ 2x {fmt_s(first.med('blocked_s'))}", r,
                          None if math.isnan(r) else r <= 2))
    if not mem:
        out.append(Target("memory targets", "not run", "", math.nan, None))
    if "DCP async_save" in methods:
        for what, ours, key in (("blocked (overlap=True)", "asyncckpt async overlap", "blocked_s"),
                                ("blocked (async)", "asyncckpt async", "blocked_s"),
                                ("staged", "asyncckpt async", "staged_s"),
                                ("durable", "asyncckpt async", "durable_s"),
                                ("hot load", "asyncckpt async", "load_hot_s"),
                                ("cold load", "asyncckpt async", "load_cold_s")):
            dcp_key = "staged_s" if what == "blocked (async)" else key
            add(f"ahead of DCP: {what}" + (" vs DCP staged" if what == "blocked (async)" else ""),
                med(ours, key), med("DCP async_save", dcp_key), 1.0)
    return out


def render(res: dict[str, Any]) -> str:
    meta = res["meta"]
    nbytes = meta["state_bytes"]
    parts = [f"## asyncckpt benchmark — {meta['date']}", "", meta["header"], ""]
    limits = res.get("limits")
    n = meta["repeats"]
    if limits:
        lm = limits["median"]
        drops = limits.get("drop_methods", {})
        rows = [
            *[[f"copy into a pre-touched buffer ({k})", fmt_s(median(v)),
               fmt_gbps(nbytes, median(v)),
               "fastest: **the copy limit**" if k == limits["copy_method"] else "slower"]
              for k, v in limits["copy_s_by_method"].items()],
            ["copy flat buffer → flat buffer (reference)", fmt_s(lm["flat_copy_s"]),
             fmt_gbps(nbytes, lm["flat_copy_s"]), "one `copy_` of the whole byte range"],
            ["O_DIRECT write + fsync, 32 MiB pieces", fmt_s(lm["odirect_write_s"]),
             fmt_gbps(nbytes, lm["odirect_write_s"]),
             "**the write limit**" + ("" if limits.get("odirect") else " (O_DIRECT refused)")],
            ["dd if=/dev/zero bs=8M conv=fsync (reference)", fmt_s(lm.get("dd_write_s", math.nan)),
             fmt_gbps(limits["dd_bytes"], lm.get("dd_write_s", math.nan)),
             f"`{limits['dd_summary'][-1]}`" if limits["dd_summary"] else ""],
            ["cold sequential read, 8 MiB preads", fmt_s(lm["cold_read_s"]),
             fmt_gbps(nbytes, lm["cold_read_s"]),
             f"**the read limit**; page cache dropped by {limits['cold_drop'][-1]}, "
             f"{max(limits['cold_residency']):.1%} left cached"],
            ["cold read in 2 parallel streams (reference)", fmt_s(lm["cold_read_2_s"]),
             fmt_gbps(nbytes, lm["cold_read_2_s"]), "two halves of the file, one thread each"],
            ["hot sequential read (reference)", fmt_s(lm["hot_read_s"]),
             fmt_gbps(nbytes, lm["hot_read_s"]), "file in the page cache"],
        ]
        for how, d in drops.items():
            state = "refused: " + d["error"] if d["error"] else "permitted"
            rows.append([f"page-cache drop by {how}", "", "",
                         f"{state}; {d['before']:.1%} → {d['after']:.1%} of the file cached"])
        parts += [f"### Machine limits (median of {n})", "",
                  table(["limit", "time", "GB/s", "notes"], rows), ""]
    methods: dict[str, MethodResult] = res.get("methods", {})
    if methods:
        rows = []
        for m in methods.values():
            first = m.first
            rows.append([m.name, fmt_s(m.med("blocked_s")), fmt_s(m.med("staged_s")),
                         fmt_s(m.med("durable_s")), fmt_gbps(nbytes, m.med("durable_s")),
                         fmt_s(m.med("load_hot_s")), fmt_s(m.med("load_cold_s")),
                         fmt_gbps(nbytes, m.med("load_cold_s")),
                         f"{fmt_s(first.get('blocked_s', math.nan))} / "
                         f"{fmt_s(first.get('durable_s', math.nan))}"])
        parts += [f"### Save and load (median of {n}; first save apart)", "",
                  table(["method", "blocked", "staged", "durable", "durable GB/s", "hot load",
                         "cold load", "cold load GB/s", "first save blocked / durable"], rows),
                  ""]
        notes = [f"- {m.name}: {note}" for m in methods.values() for note in m.notes]
        if notes:
            parts += [*notes, ""]
        if limits:
            lm = limits["median"]
            rows = []
            for m in methods.values():
                rows.append([m.name, fmt_x(ratio(m.med("blocked_s"), lm["copy_s"])),
                             fmt_x(ratio(m.med("durable_s"), lm["odirect_write_s"])),
                             fmt_x(ratio(m.med("load_hot_s"), lm["copy_s"])),
                             fmt_x(ratio(lm["cold_read_s"], m.med("load_cold_s")))])
            parts += ["### Ratios to the limits section's medians", "",
                      table(["method", "blocked / copy", "durable / O_DIRECT write",
                             "hot load / copy", "cold load BW / cold read BW"], rows), ""]
        if any(m.paired_copy_s for m in methods.values()):
            rows = []
            for m in methods.values():
                rows.append([
                    m.name, fmt_s(median(m.paired_copy_s)), fmt_s(median(m.paired_write_s)),
                    fmt_gbps(nbytes, median(m.paired_read_s)),
                    fmt_x(m.paired("blocked_s", "paired_copy_s")),
                    fmt_x(m.paired("durable_s", "paired_write_s")),
                    fmt_x(m.paired("load_hot_s", "paired_copy_s")),
                    fmt_x(m.paired("load_cold_s", "paired_read_s", bandwidth=True))])
            parts += [f"### Ratios to the limits measured beside each save (median of {n} "
                      "per-save ratios)", "",
                      "The disk of this VM drifts 2-4x within minutes, so every save was "
                      "paired, in the same minute, with a copy of the state into a pre-touched "
                      "buffer (right before the save) and a limit round (after the save and "
                      "its loads, or before them, alternating): an O_DIRECT write + fsync of "
                      "as many bytes, then a cold sequential read (8 MiB preads) of that "
                      "fresh file, as the method's cold load reads its fresh checkpoint. The "
                      "targets use these ratios.", "",
                      table(["method", "copy beside", "O_DIRECT write beside",
                             "cold read beside (GB/s)", "blocked / copy", "durable / write",
                             "hot load / copy", "cold load BW / read BW"], rows), ""]
    mem = res.get("memory")
    if mem:
        def row(what: str, b: float) -> list[str]:
            return [what, f"{b / GiB:.3f} GiB", f"{b / nbytes:.3f}x"]

        rows = [row("extra RSS after the first save", mem["first_extra"]),
                row("extra RSS after the last save", mem["last_extra"]),
                row("max extra RSS (sampled every 10 ms)", mem["max_extra"]),
                row("growth after the first save", mem["growth"]),
                row("extra RSS after close()", mem["extra_after_close"]),
                ["prepare() at start-up (allocates the arena)",
                 fmt_s(mem.get("prepare_s", math.nan)), ""],
                ["first-save blocked", fmt_s(mem["first_blocked_s"]),
                 fmt_x(ratio(mem["first_blocked_s"], mem["later_blocked_median_s"]))
                 + " the later median"],
                ["median later-save blocked", fmt_s(mem["later_blocked_median_s"]), ""],
                ["median durable", fmt_s(median(mem["durable_s"])), ""]]
        parts += [f"### Memory: {mem['saves']} consecutive async saves, keep_last=2 "
                  f"(baseline RSS {mem['baseline_rss'] / GiB:.2f} GiB incl. the state)", "",
                  table(["measure", "value", "x state"], rows), ""]
    targets: list[Target] = res.get("targets_obj", [])
    if targets:
        parts += ["### Targets", "",
                  table(["target", "measured", "threshold", "ratio", "verdict"],
                        [[t.name, t.measured, t.threshold, fmt_x(t.ratio), t.verdict]
                         for t in targets]), ""]
    if res.get("dist"):
        import bench_dist

        parts += [bench_dist.render(res["dist"]), ""]
    if res.get("peer"):
        import bench_peer

        parts += [bench_peer.render(res["peer"]), ""]
    parts.append(f"Peak RSS of the run: {meta.get('peak_rss', 0) / GiB:.2f} GiB; wall time "
                 f"{meta.get('wall_s', 0):.0f} s.")
    return "\n".join(parts)


# --- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke test: ~64 MiB state, ~100 tensors, 1 repeat, 5 saves")
    p.add_argument("--dir", type=Path, default=None,
                   help=f"where to write checkpoints (a fresh subfolder is made and removed); "
                        f"default {DEFAULT_OUT}. Not tmpfs: it would hide the disk")
    p.add_argument("--repeats", type=int, default=None, help="runs per measurement (3; quick 1)")
    p.add_argument("--saves", type=int, default=None,
                   help="saves in the memory test (20; quick 5)")
    p.add_argument("--state-gib", type=float, default=None,
                   help="state size in GiB: model + 2 AdamW moments (3; quick 1/16)")
    p.add_argument("--tensors", type=int, default=None,
                   help="model tensors, each with 2 moments and a step (1000; quick 100)")
    p.add_argument("--dcp-threads", type=int, default=2,
                   help="FileSystemWriter thread_count for DCP (default 2)")
    p.add_argument("--world", type=int, default=2,
                   help="ranks of the dist section (default 2)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch.set_num_threads for the whole run (default: torch's default)")
    p.add_argument("--only", action="append", default=None, metavar="SECTIONS",
                   help=f"comma-separated sections to run, from {', '.join(SECTIONS)}")
    p.add_argument("--json", type=Path, default=None, help="write all raw results here")
    args = p.parse_args(argv)
    only: set[str] = set()
    for item in args.only or [",".join(SECTIONS)]:
        only.update(s.strip() for s in item.split(",") if s.strip())
    unknown = only - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; use {', '.join(SECTIONS)}")
    args.sections = only
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.saves = args.saves or (5 if args.quick else 20)
    args.state_gib = args.state_gib or (1 / 16 if args.quick else 3.0)
    args.tensors = args.tensors or (100 if args.quick else 1000)
    if args.repeats < 1 or args.saves < 2 or args.state_gib <= 0 or args.tensors < 16:
        p.error("need --repeats >= 1, --saves >= 2, --state-gib > 0, --tensors >= 16")
    if args.world < 2:
        p.error("need --world >= 2")
    return args


def library_revision() -> str:
    """The git commit of the checkout asyncckpt is imported from ("+dirty" with local edits)."""
    src = Path(asyncckpt.__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def header(m: lim.Machine, nbytes: int, n_tensors: int, n_model: int, work: Path,
           args: argparse.Namespace) -> str:
    return (f"Machine: {m.cores} cores ({m.cpu}), {m.ram_gib:.1f} GiB RAM, Linux {m.kernel}, "
            f"THP {m.thp}; Python {m.python}, torch {m.torch} ({m.torch_threads} threads), "
            f"asyncckpt {asyncckpt.__version__} (git {library_revision()}). "
            f"State: {nbytes / GiB:.3f} GiB "
            f"({nbytes / GB:.3f} GB) in {n_tensors} tensors (model: {n_model} fp32 tensors + "
            f"AdamW exp_avg, exp_avg_sq, step). Checkpoints under {work} on "
            f"{lim.filesystem_of(work)}. Repeats: {args.repeats}; 1 GB = 1e9 B.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    base = (args.dir or DEFAULT_OUT).resolve()
    _remove_dead_runs(base)
    work = base / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    work.mkdir(parents=True)
    fs = lim.filesystem_of(work)
    if fs.startswith("tmpfs"):
        log(f"warning: {work} is on tmpfs; disk numbers will be memory numbers")
    try:
        dist_res = None
        if "dist" in args.sections:  # first: its ranks get the memory our state would take
            import bench_dist

            log("--- dist")
            dist_res = bench_dist.run(args, work / "dist")
            free_memory()
        peer_res = None
        if "peer" in args.sections:  # first too: the serving process needs the memory
            import bench_peer

            log("--- peer")
            peer_res = bench_peer.run(args, work / "peer")
            free_memory()
        single = bool(args.sections - {"dist", "peer"})  # sections that need a state here
        model_floats = int(args.state_gib * GiB / 12)
        state: State = {"model": {}}
        if single:
            log(f"building a {args.state_gib:.3g} GiB state of ~{args.tensors} model tensors")
            t0 = time.perf_counter()
            state = build_state(model_floats, args.tensors)
        nbytes, n_tensors = state_bytes(state), sum(1 for _ in named_tensors(state))
        n_model = len(state["model"])
        if single:
            log(f"built {nbytes / GiB:.3f} GiB in {n_tensors} tensors in "
                f"{time.perf_counter() - t0:.1f}s")
        elif dist_res is not None:  # the dist section alone: its state's numbers
            nbytes, n_tensors = dist_res["state_bytes"], dist_res["tensors"]
            n_model = dist_res["model_tensors"]
        elif peer_res is not None:
            nbytes, n_tensors = peer_res["state_bytes"], peer_res["tensors"]
            n_model = peer_res["model_tensors"]
        ctx = Context(state, nbytes, work, args.repeats, args.saves, args.dcp_threads)
        machine = lim.machine()
        res: dict[str, Any] = {"meta": {
            "date": dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "machine": asdict(machine), "state_bytes": nbytes, "tensors": n_tensors,
            "model_tensors": n_model, "repeats": args.repeats,
            "saves": args.saves, "dir": str(work), "filesystem": fs,
            "sections": sorted(args.sections), "argv": list(argv or sys.argv[1:]),
            "header": header(machine, nbytes, n_tensors, n_model, work, args)}}
        if dist_res is not None:
            res["dist"] = dist_res
        if peer_res is not None:
            res["peer"] = peer_res
        methods: dict[str, MethodResult] = {}
        for section in RUN_ORDER:
            if section not in args.sections:
                continue
            log(f"--- {section}")
            if section == "memory":
                res["memory"] = run_memory(ctx)
            elif section == "limits":
                res["limits"] = run_limits(ctx)
            elif section == "asyncckpt":
                methods.update(run_asyncckpt(ctx))
            elif section == "torch_save":
                methods["torch.save"] = run_anchor(
                    ctx, lambda r: TorchSaveMethod(r, state), first_save=False)
            elif section == "safetensors":
                methods["safetensors"] = run_anchor(
                    ctx, lambda r: SafetensorsMethod(r, state), first_save=False)
                methods["asyncckpt.load_safetensors"] = run_anchor(
                    ctx, lambda r: SafetensorsImportMethod(r, state), first_save=False)
            elif section == "dcp":
                methods["DCP async_save"] = run_anchor(
                    ctx, lambda r: DcpMethod(r, state, ctx.dcp_threads), first_save=True)
            free_memory()
        if ctx.paired is not None:
            ctx.paired.close()
            ctx.paired = None
        res["methods"] = methods
        targets = evaluate_targets(res, nbytes) if single else []
        res["targets_obj"] = targets
        res["meta"]["peak_rss"] = lim.peak_rss_bytes()
        res["meta"]["wall_s"] = time.perf_counter() - started
        print(render(res))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(to_json(res), indent=1, default=str, allow_nan=False)
            args.json.write_text(text + "\n")
            log(f"wrote {args.json}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _remove_dead_runs(base: Path) -> None:
    """Remove the run folders of earlier runs that were killed (a timeout's SIGTERM runs
    no cleanup): each holds gigabytes of checkpoints, and they piled up to fill the disk."""
    if not base.is_dir():
        return
    for old in base.glob("run-*-*"):
        try:
            pid = int(old.name.rsplit("-", 1)[1])
            os.kill(pid, 0)  # alive (or not ours to ask): keep it
            continue
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        log(f"removing {old}: left by a run (pid {pid}) that no longer runs")
        shutil.rmtree(old, ignore_errors=True)


def to_json(res: dict[str, Any]) -> Any:
    """The results as strict JSON data (NaN becomes null)."""
    out = {k: v for k, v in res.items() if k not in ("methods", "targets_obj")}
    out["methods"] = {k: m.to_json() for k, m in res.get("methods", {}).items()}
    out["targets"] = [{**asdict(t), "verdict": t.verdict} for t in res.get("targets_obj", [])]
    return _finite(out)


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


if __name__ == "__main__":
    raise SystemExit(main())
