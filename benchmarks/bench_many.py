"""Benchmark the per-tensor cost: a state of many small tensors (an MoE's experts, a model
kept unfused), beside the machine's limits and the usual anchors.

The main benchmark (``bench_checkpoint.py``) has ~4,000 tensors of ~1 MiB, where bytes
dominate; here every tensor is 16 KiB by default, so what a method spends per tensor
(Python, metadata, checksums, syscalls) is what is measured. The state: ``--layers``
layers, each a 64x64 fp32 weight with its AdamW ``step``, ``exp_avg`` and ``exp_avg_sq``
(4 tensors a layer: 100,000 tensors, 1.2 GiB, by default).

Measured, medians of ``--repeats`` runs:

* limits -- memcpy of every tensor into a pre-touched buffer (2 threads), an O_DIRECT
  write + fsync of as many bytes, a hot sequential read of them;
* asyncckpt (mode async) -- save blocked and durable; in-place load and fresh load
  (``asyncckpt.load(path)``), with the files in the page cache;
* torch.save (+ fsync) / torch.load(weights_only=True); safetensors save_file (+ fsync) /
  load_file (its keys flattened first); DCP ``save`` / ``load`` in place (``--no-dcp``
  skips it: it is the slowest by far).

Usage:
    python benchmarks/bench_many.py                  # 100,000 tensors
    python benchmarks/bench_many.py --quick          # 4,000 tensors, 1 repeat
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import _limits as lim
import asyncckpt

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "bench-out"
State = dict[str, Any]


def log(msg: str) -> None:
    print(f"[many {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_state(layers: int, side: int) -> State:
    """``layers`` weights of ``side`` x ``side`` fp32 with their AdamW state."""
    gen = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(side, side, generator=gen) for i in range(layers)}
    optim = {i: {"step": torch.tensor(float(i)),
                 "exp_avg": torch.randn(side, side, generator=gen),
                 "exp_avg_sq": torch.rand(side, side, generator=gen)} for i in range(layers)}
    return {"model": model, "optim": {"state": optim}}


def leaves(state: State) -> dict[str, torch.Tensor]:
    """Every tensor of the state under a flat ``/``-joined name."""
    out = {f"model/{k}": v for k, v in state["model"].items()}
    for i, d in state["optim"]["state"].items():
        for k, v in d.items():
            out[f"optim/state/{i}/{k}"] = v
    return out


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def warm(path: Path) -> None:
    """Read every file under ``path`` once, so that the loads measured are hot."""
    for f in lim.files_under(path):
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass


def timed(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[float, Any]:
    """(seconds, result) of ``fn(*args, **kw)``."""
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out


def check_equal(state: State, got: dict[str, torch.Tensor], who: str) -> None:
    """Every loaded tensor must equal the state's: a fast method that loads wrong bytes
    measures nothing."""
    want = leaves(state)
    if set(got) != set(want):
        raise AssertionError(f"{who}: loaded keys differ from the saved ones")
    bad = [k for k, v in want.items() if not torch.equal(v, got[k])]
    if bad:
        raise AssertionError(f"{who}: {len(bad)} tensors differ, e.g. {bad[0]}")


def flat_of(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    out: dict[str, torch.Tensor] = {}
    for k, v in tree.items():
        out.update(flat_of(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


# --- methods ---------------------------------------------------------------------------------


def run_asyncckpt(state: State, work: Path, repeats: int) -> dict[str, list[float]]:
    res: dict[str, list[float]] = {"blocked": [], "durable": [], "load_in_place": [],
                                   "load_fresh": [], "first_blocked": []}
    root = work / "asyncckpt"
    with asyncckpt.AsyncCheckpointer(root, mode="async", keep_last=1) as ckpt:
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            fut = ckpt.save_async(state, step=r)
            blocked = time.perf_counter() - t0
            info = fut.wait()
            durable = time.perf_counter() - t0
            if r == 0:  # the first save allocates the host buffer: reported apart
                res["first_blocked"].append(blocked)
                continue
            warm(info.path)
            asyncckpt.load(info.path, state)  # (a first load warms the reader threads)
            in_place, _ = timed(asyncckpt.load, info.path, state)
            fresh, got = timed(asyncckpt.load, info.path)
            check_equal(state, flat_of(got), "asyncckpt fresh load")
            del got
            res["blocked"].append(blocked)
            res["durable"].append(durable)
            res["load_in_place"].append(in_place)
            res["load_fresh"].append(fresh)
            log(f"asyncckpt {r}/{repeats}: blocked {blocked:.3f}s durable {durable:.3f}s | load "
                f"in place {in_place:.3f}s fresh {fresh:.3f}s")
    return res


def run_one_file(label: str, path: Path, save: Callable[[Path], Any],
                 load: Callable[[Path], Any], flat: Callable[[Any], dict[str, torch.Tensor]],
                 state: State, repeats: int) -> dict[str, list[float]]:
    """A method that writes one file: ``save(path)`` then fsync is its durable time;
    ``load(path)``, from the page cache, its fresh load (checked against ``state``)."""
    res: dict[str, list[float]] = {"durable": [], "load_fresh": []}
    for r in range(repeats):
        t0 = time.perf_counter()
        save(path)
        fsync_path(path)
        durable = time.perf_counter() - t0
        warm(path)
        fresh, got = timed(load, path)
        check_equal(state, flat(got), label)
        del got
        res["durable"].append(durable)
        res["load_fresh"].append(fresh)
        log(f"{label} {r + 1}/{repeats}: durable {durable:.3f}s | load {fresh:.3f}s")
        path.unlink()
    return res


def run_torch_save(state: State, work: Path, repeats: int) -> dict[str, list[float]]:
    return run_one_file("torch.save / torch.load", work / "state.pt",
                        lambda p: torch.save(state, p),
                        lambda p: torch.load(p, weights_only=True), flat_of, state, repeats)


def run_safetensors(state: State, work: Path, repeats: int) -> dict[str, list[float]]:
    from safetensors.torch import load_file, save_file

    return run_one_file("safetensors save_file / load_file", work / "state.safetensors",
                        lambda p: save_file(leaves(state), str(p)),
                        lambda p: load_file(str(p)), lambda got: got, state, repeats)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def run_dcp(state: State, work: Path, repeats: int) -> dict[str, list[float]]:
    import torch.distributed.checkpoint as dcp

    res: dict[str, list[float]] = {"durable": [], "load_in_place": []}
    for r in range(repeats):
        path = work / f"dcp_{r}"
        with _quiet():
            writer = dcp.FileSystemWriter(str(path), thread_count=2, sync_files=True)
            durable, _ = timed(dcp.save, state, storage_writer=writer)
            warm(path)
            in_place, _ = timed(dcp.load, state, checkpoint_id=str(path))
        res["durable"].append(durable)
        res["load_in_place"].append(in_place)
        log(f"DCP {r + 1}/{repeats}: save {durable:.3f}s | load in place {in_place:.3f}s")
        shutil.rmtree(path)
    return res


def run_limits(tensors: list[torch.Tensor], work: Path, repeats: int) -> dict[str, float]:
    nbytes = lim.packed_nbytes(tensors)
    buf = lim.AlignedBuffer(nbytes)
    try:
        views = buf.views_like(tensors)
        copies = [lim.memcpy_tensors(views, tensors, 2) for _ in range(repeats + 1)][1:]
        del views
        path = work / "limit.bin"
        writes, reads = [], []
        for _ in range(repeats):
            writes.append(lim.odirect_write(path, buf.memoryview(), nbytes)[0])
            lim.sequential_read(path, buf.memoryview())  # (into the page cache)
            reads.append(lim.sequential_read(path, buf.memoryview())[0])
        path.unlink()
    finally:
        buf.close()
    out = {"copy_s": statistics.median(copies), "write_s": statistics.median(writes),
           "hot_read_s": statistics.median(reads)}
    log(f"limits: copy {out['copy_s']:.3f}s, O_DIRECT write {out['write_s']:.3f}s, hot read "
        f"{out['hot_read_s']:.3f}s")
    return out


# --- report ----------------------------------------------------------------------------------


def fmt(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def render(res: dict[str, Any]) -> str:
    n, nbytes, lm = res["tensors"], res["bytes"], res["limits"]
    per = 1e6 / n

    def med(method: str, key: str) -> float | None:
        xs = res["methods"].get(method, {}).get(key)
        return statistics.median(xs) if xs else None

    def cell(method: str, key: str, limit: float | None = None) -> str:
        s = med(method, key)
        if s is None:
            return "-"
        extra = f", {s / limit:.1f}x" if limit else ""
        return f"{fmt(s)} ({s * per:.1f} µs/tensor{extra})"

    lines = [
        f"## Many small tensors — {res['when']}", "",
        f"Machine: {res['machine']}. State: {n:,} tensors, {nbytes / 1e9:.3f} GB "
        f"({res['layers']:,} layers of a {res['side']}x{res['side']} fp32 weight with its AdamW "
        f"step, exp_avg, exp_avg_sq). Medians of {res['repeats']}; files in the page cache for "
        "every load; µs/tensor = seconds / tensors.", "",
        "| limit | time |", "|---|---|",
        f"| memcpy of every tensor into a pre-touched buffer (2 threads): **the copy** | "
        f"{fmt(lm['copy_s'])} |",
        f"| O_DIRECT write + fsync of as many bytes: **the write** | {fmt(lm['write_s'])} |",
        f"| hot sequential read of as many bytes: **the read** | {fmt(lm['hot_read_s'])} |", "",
        "| method | save: blocked (x copy) | save: durable (x write) | load in place (x read) "
        "| load into fresh tensors (x read) |",
        "|---|---|---|---|---|",
    ]
    names = {"asyncckpt": "asyncckpt async", "torch_save": "torch.save / torch.load",
             "safetensors": "safetensors save_file / load_file", "dcp": "DCP save / load"}
    for m, label in names.items():
        if m not in res["methods"]:
            continue
        blocked = cell(m, "blocked", lm["copy_s"]) if m == "asyncckpt" else "= durable"
        lines.append(f"| {label} | {blocked} | {cell(m, 'durable', lm['write_s'])} | "
                     f"{cell(m, 'load_in_place', lm['hot_read_s'])} | "
                     f"{cell(m, 'load_fresh', lm['hot_read_s'])} |")
    first = med("asyncckpt", "first_blocked")
    if first is not None:
        lines += ["", f"- asyncckpt's first save (allocates the host buffer, no `prepare()`) "
                      f"blocked {fmt(first)}."]
    for m in res.get("skipped", []):
        lines.append(f"- not measured: {m}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 1,000 layers, 1 repeat")
    p.add_argument("--layers", type=int, default=None, help="layers of 4 tensors (25,000)")
    p.add_argument("--side", type=int, default=64, help="each weight is side x side fp32 (64)")
    p.add_argument("--repeats", type=int, default=None, help="runs per measurement (3)")
    p.add_argument("--no-dcp", action="store_true", help="skip DCP (the slowest)")
    p.add_argument("--only", default=None,
                   help="comma-separated methods from asyncckpt, torch_save, safetensors, dcp")
    p.add_argument("--dir", type=Path, default=DEFAULT_OUT, help="where to write (not tmpfs)")
    p.add_argument("--json", type=Path, default=None, help="write the raw results here")
    args = p.parse_args(argv)
    if args.layers is None:
        args.layers = 1000 if args.quick else 25_000
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.layers < 1 or args.side < 1 or args.repeats < 1:
        p.error("--layers, --side and --repeats must be positive")
    methods = ("asyncckpt", "torch_save", "safetensors", "dcp")
    args.methods = methods if args.only is None else tuple(
        m.strip() for m in args.only.split(",") if m.strip())
    unknown = [m for m in args.methods if m not in methods]
    if unknown:
        p.error(f"--only: unknown method(s) {', '.join(unknown)}; choose from {', '.join(methods)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.dir / f"many-{dt.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
    work.mkdir(parents=True)
    try:
        log(f"building {args.layers:,} layers ({4 * args.layers:,} tensors)")
        state = build_state(args.layers, args.side)
        tensors = list(leaves(state).values())
        m = lim.machine()
        res: dict[str, Any] = {
            "when": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "machine": (f"{m.cores} cores ({m.cpu}), {m.ram_gib:.1f} GiB, {m.kernel}, "
                        f"torch {m.torch}"),
            "tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors),
            "layers": args.layers, "side": args.side, "repeats": args.repeats,
            "limits": run_limits(tensors, work, args.repeats), "methods": {}, "skipped": []}
        runners = {"asyncckpt": run_asyncckpt, "torch_save": run_torch_save,
                   "safetensors": run_safetensors, "dcp": run_dcp}
        for name in args.methods:
            if name == "dcp" and args.no_dcp:
                res["skipped"].append("DCP (--no-dcp)")
                continue
            gc.collect()
            res["methods"][name] = runners[name](state, work, args.repeats)
        print(render(res))
        if args.json is not None:
            args.json.write_text(json.dumps(res, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
