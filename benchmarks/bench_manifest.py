"""Benchmark what the coordinator of a group spends on the manifest at every save, and what
each rank's record costs the Store, at world sizes this machine cannot run as processes.

Every rank's part is built as a real rank builds it (flatten, declared shards, write plan,
its record); the checksums are random hex, since hashing is the ranks' own work, beside
their writes. Each rank holds ``--tensors`` tensors, each sharded along dimension 0 over
all ranks (``Shard(0)``), so the manifest has ranks x tensors chunks. Measured, medians of
``--repeats`` saves:

* *whole merge* -- what every save cost before records were reported as deltas, and what
  a save whose layout changed still costs: merge the whole records, encode the manifest,
  read it back as a load will (``dist.merge_records``, ``Manifest.to_json``,
  ``parse_manifest``);
* *first save* -- ``RecordBook.manifest`` of whole records (the same, and it keeps the
  template);
* *steady save* -- ``RecordBook.manifest`` of deltas of the same layouts: checksums
  checked and filled in, the skeleton unchanged;
* *skeleton changed* -- the same, every rank's learning rate changed (a skeleton patch
  from each rank: the coordinator patches, merges and checks the skeletons again);
* the bytes a rank puts in the Store for its record: whole, as a delta, and as a delta
  with its skeleton patch;
* what *every rank of a load* spends reading the manifest (``parse_manifest`` with the
  collector paused, as ``read_manifest`` runs it), its bytes and the memory the parsed
  manifest holds, in this format version (from 16 chunks a tensor, a table of them), in
  version 3 (every chunk a short list) and in version 2 (every chunk an object).

Usage:
    python benchmarks/bench_manifest.py                     # 64 ranks x 2,000 tensors
    python benchmarks/bench_manifest.py --world 256 --tensors 1000
    python benchmarks/bench_manifest.py --quick             # 8 ranks x 200 tensors
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import gc
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch

import _limits as lim
from asyncckpt import ShardMetadata
from asyncckpt._gc import gc_paused
from asyncckpt.dist import merge_records
from asyncckpt.loader import apply_shards
from asyncckpt.manifest import (
    DEFAULT_BLOCK_BYTES,
    FORMAT_VERSION,
    Manifest,
    parse_manifest,
    shard_file_name,
)
from asyncckpt.plan import plan_writes
from asyncckpt.reports import RecordBook, RecordSender
from asyncckpt.tree import flatten

KW: dict[str, Any] = {"library_version": "bench", "block_bytes": DEFAULT_BLOCK_BYTES,
                      "user_metadata": {}}


def log(msg: str) -> None:
    print(f"[manifest {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Rank:
    """One rank: its flattened state, write plan and record sender."""

    def __init__(self, r: int, world: int, tensors: int, rows: int):
        state: dict[str, Any] = {
            "model": {f"layers.{i}.weight": torch.zeros(rows, 8) for i in range(tensors)},
            "train": {"lr": 1e-3}}
        self.r, self.lr = r, 1e-3
        self.flat = flatten(state)
        apply_shards(self.flat, {f"model/layers.{i}.weight": ShardMetadata(
            (rows * world, 8), (rows * r, 0)) for i in range(tensors)})
        self.plan = plan_writes(self.flat.tensors, shard_file_name(r))
        self.sender = RecordSender()
        self._n = 0

    def record(self, skeleton_changes: bool) -> dict[str, Any]:
        self._n += 1
        if skeleton_changes:  # a fresh skeleton whose lr moved
            self.lr *= 0.99
            skeleton = copy.deepcopy(self.flat.skeleton)
            train = dict(skeleton["items"])["train"]
            train["items"][0][1]["v"] = repr(self.lr)
            self.flat = dataclasses.replace(self.flat, skeleton=skeleton)
        sums = [[f"{(self.r * 1_000_003 + self._n * 7919 + i) & (2**64 - 1):016x}"]
                for i in range(len(self.plan.items))]
        return self.sender.record(rank=self.r, coordinator="bench", plan=self.plan,
                                  flat=self.flat, sums=sums, replicas={})


def through_store(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """The records as the coordinator gets them from the Store (JSON), and their sizes."""
    raw = [json.dumps(rec).encode() for rec in records]
    return [json.loads(b) for b in raw], [len(b) for b in raw]


def whole_merge(records: list[dict[str, Any]], step: int) -> tuple[float, Manifest]:
    t = time.perf_counter()
    manifest = merge_records(records, step=step, created_unix=time.time(), **KW)
    raw = manifest.to_json()
    parse_manifest(raw, "bench")
    return time.perf_counter() - t, manifest


def rank_parse(manifest: Manifest, version: int) -> tuple[int, float, int]:
    """The bytes of ``manifest`` in format ``version``, the time a rank of a load takes to
    parse them (as read_manifest does: the cyclic collector paused) and the bytes of
    Python and numpy memory the parsed manifest holds (tracemalloc, in a second parse)."""
    raw = dataclasses.replace(manifest, format_version=version).to_json()
    gc.collect()
    with gc_paused():
        t = time.perf_counter()
        back = parse_manifest(raw, "bench")
        took = time.perf_counter() - t
    assert back.format_version == version and len(back.tensors) == len(manifest.tensors)
    del back
    gc.collect()
    tracemalloc.start()
    try:
        with gc_paused():
            back = parse_manifest(raw, "bench")
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        assert back.step == manifest.step  # (held until here)
    finally:
        tracemalloc.stop()
    return len(raw), took, held


def settle(ranks: list[Rank], committed: bool = True) -> None:
    for rk in ranks:
        rk.sender.settled(committed)


def timed_manifest(book: RecordBook, records: list[dict[str, Any]], step: int) -> float:
    t = time.perf_counter()
    book.manifest(records, step=step, created_unix=time.time(), **KW)
    return time.perf_counter() - t


def run(world: int, tensors: int, repeats: int) -> dict[str, Any]:
    log(f"building {world} ranks x {tensors:,} tensors")
    ranks = [Rank(r, world, tensors, rows=4) for r in range(world)]
    res: dict[str, Any] = {"whole_merge": [], "first_save": [], "steady_save": [],
                           "skeleton_changed": [], "parse": [], "parse_v3": [], "parse_v2": [],
                           "held": [], "held_v3": []}
    for rep in range(repeats):
        book = RecordBook()
        settle(ranks, False)  # report whole
        gc.collect()
        records, whole_sizes = through_store([rk.record(False) for rk in ranks])
        took, manifest = whole_merge(records, step=rep)
        res["whole_merge"].append(took)
        res["manifest_bytes"], parse, held = rank_parse(manifest, FORMAT_VERSION)
        res["manifest_bytes_v3"], parse_v3, held_v3 = rank_parse(manifest, 3)
        res["manifest_bytes_v2"], parse_v2, _ = rank_parse(manifest, 2)
        res["parse_v3"].append(parse_v3)
        res["held"].append(held)
        res["held_v3"].append(held_v3)
        res["parse"].append(parse)
        res["parse_v2"].append(parse_v2)
        del manifest
        res["first_save"].append(timed_manifest(book, records, rep))
        settle(ranks)
        records, delta_sizes = through_store([rk.record(False) for rk in ranks])
        assert all("tensors" not in rec for rec in records)
        res["steady_save"].append(timed_manifest(book, records, rep))
        settle(ranks)
        records, skel_sizes = through_store([rk.record(True) for rk in ranks])
        assert all("skeleton_patch" in rec for rec in records)
        res["skeleton_changed"].append(timed_manifest(book, records, rep))
        settle(ranks)
        log(f"repeat {rep + 1}: whole merge {res['whole_merge'][-1]:.3f} s, steady save "
            f"{res['steady_save'][-1]:.3f} s")
    res["record_bytes"] = {"whole": statistics.median(whole_sizes),
                           "delta": statistics.median(delta_sizes),
                           "delta_with_skeleton": statistics.median(skel_sizes)}
    return res


def render(res: dict[str, Any]) -> str:
    r = res["run"]
    med = {k: statistics.median(v) for k, v in r.items() if isinstance(v, list)}
    base = med["whole_merge"]
    rb = r["record_bytes"]
    lines = [
        f"Coordinator's manifest per save, {res['world']} ranks x {res['tensors']:,} Shard(0) "
        f"tensors ({res['world'] * res['tensors']:,} chunks), medians of {res['repeats']} "
        f"({res['when']}; {res['machine']})", "",
        "| per save | coordinator time | vs whole merge |", "|---|---|---|"]
    names = {"whole_merge": "whole merge (every save before; a changed layout now)",
             "first_save": "first save (whole records, template kept)",
             "steady_save": "steady save (deltas, same skeletons)",
             "skeleton_changed": "deltas, every rank's lr changed (skeleton patches)"}
    for key, label in names.items():
        lines.append(f"| {label} | {med[key]:.3f} s | {med[key] / base:.2f}x |")
    lines += ["", "| record in the Store, per rank | bytes |", "|---|---|",
              f"| whole | {rb['whole']:,.0f} |", f"| delta | {rb['delta']:,.0f} |",
              f"| delta with a changed lr (its skeleton patch) | "
              f"{rb['delta_with_skeleton']:,.0f} |"]
    v3 = med["parse_v3"]
    lines += ["", "| every rank of a load: the manifest | bytes | parse | vs version 3 | held |",
              "|---|---|---|---|---|",
              f"| format version {FORMAT_VERSION} (tables of chunks from 16 a tensor) | "
              f"{r['manifest_bytes']:,} | {med['parse']:.3f} s | {med['parse'] / v3:.2f}x | "
              f"{med['held'] / 1e6:.0f} MB |",
              f"| format version 3 (short chunks) | {r['manifest_bytes_v3']:,} | {v3:.3f} s | "
              f"1.00x | {med['held_v3'] / 1e6:.0f} MB |",
              f"| format version 2 (every chunk an object) | {r['manifest_bytes_v2']:,} | "
              f"{med['parse_v2']:.3f} s | {med['parse_v2'] / v3:.2f}x | |"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 8 ranks x 200, 1 repeat")
    p.add_argument("--world", type=int, default=None, help="ranks (64)")
    p.add_argument("--tensors", type=int, default=None, help="tensors per rank (2,000)")
    p.add_argument("--repeats", type=int, default=None, help="saves of each kind (3)")
    p.add_argument("--json", type=Path, default=None, help="write the raw results here")
    args = p.parse_args(argv)
    args.world = args.world or (8 if args.quick else 64)
    args.tensors = args.tensors or (200 if args.quick else 2000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if min(args.world, args.tensors, args.repeats) < 1:
        p.error("--world, --tensors and --repeats must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    m = lim.machine()
    res = {"when": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
           "machine": f"{m.cores} cores ({m.cpu}), {m.ram_gib:.1f} GiB, torch {m.torch}",
           "world": args.world, "tensors": args.tensors, "repeats": args.repeats,
           "run": run(args.world, args.tensors, args.repeats)}
    print(render(res))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
