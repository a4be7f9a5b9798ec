"""Saving with N ranks and loading with M ranks: bit-exact resharding, layout and async.

Each save world runs once (one spawn saves every placement), each load world runs
once (one spawn loads every checkpoint it is paired with), and the tests below read
their slice of what those spawns found. Workers (``*_worker``) run in the ranks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import Checks, RankCtx, bits, full_tensor, run_ranks, same_bits, split_sizes
from _manifests import long_entries
from _torch_compat import distribute_locally, dtensor_api, fsdp2_on_cpu, fully_shard_fn

import asyncckpt

MODULE = "test_dist_save_load"
PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2), (4, 1), (2, 3), (3, 2)]
PLACES = ("S0", "S1", "R")
SHAPE = (10, 7)  # 10 rows split 3 ways: 4, 4, 2; split 4 ways: 3, 3, 3, 1
DTYPES = ("float32", "bfloat16")
VEC = (5,)  # Shard(0) on 4 ranks: 2, 2, 1, 0 (an empty shard)
BIG = (256, 1024)  # float32, 1 MiB, saved replicated: one chunk
HAND = (6, 9)  # saved row-split by hand, loaded column-split by hand
SPREAD = 12  # equal replicated tensors of the spreading check
SPREAD_SHAPE = (64, 64)
BLOCK = 64 * 1024  # the saves' checksum block: resharding reads whole blocks
STEP = 5
META = {"epoch": 3, "name": "exp-\u03b1/\u03b2", "lr": 0.25, "nothing": None,
        "flags": [True, False], "pair": (1, "x"), "blob": b"\x00\xff"}


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _placement(name: str) -> Any:
    dt = dtensor_api()
    Replicate, Shard = dt.Replicate, dt.Shard

    return {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}[name]


def _dt(name: str, shape: tuple[int, ...], dtype: str, mesh: Any, placements: list[Any],
        zero: bool = False) -> Any:
    """A DTensor of the global value of ``name`` (or zeros), split by torch, no comm."""
    import torch

    full = full_tensor(name, shape, _dtype(dtype))
    if zero:
        full = torch.zeros_like(full)
    return distribute_locally(full, mesh, placements)


def _hand_rows(world: int, rank: int) -> tuple[int, int]:
    sizes = split_sizes(HAND[0], world)
    return sum(sizes[:rank]), sizes[rank]


def _hand_cols(world: int, rank: int) -> tuple[int, int]:
    sizes = split_sizes(HAND[1], world)
    return sum(sizes[:rank]), sizes[rank]


def _meshes(world: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")) if world == 4 else None
    return mesh, mesh2


# --- the save spawn ----------------------------------------------------------------------------

def save_worker(ctx: RankCtx) -> dict[str, Any]:
    import torch
    dt = dtensor_api()
    Replicate, Shard = dt.Replicate, dt.Shard

    world, rank = ctx.world, ctx.rank
    mesh, mesh2 = _meshes(world)
    r0, nr = _hand_rows(world, rank)
    state: dict[str, Any] = {
        "dt": {p: {d: _dt(f"dt/{p}/{d}", SHAPE, d, mesh, [_placement(p)]) for d in DTYPES}
               for p in PLACES},
        "vec": _dt("vec", VEC, "float64", mesh, [Shard(0)]),
        "big": _dt("big", BIG, "float32", mesh, [Replicate()]),
        "plain": {"a": full_tensor("plain/a", (3, 4), torch.int32),
                  "b": full_tensor("plain/b", (16,), torch.float16)},
        "hand": {"w": full_tensor("hand/w", HAND)[r0:r0 + nr].clone()},
        "meta": {**META, "saved_by": world},
    }
    if mesh2 is not None:
        state["mesh2d"] = {"ss": _dt("mesh2d/ss", SHAPE, "float32", mesh2, [Shard(0), Shard(1)]),
                           "rs": _dt("mesh2d/rs", SHAPE, "float32", mesh2,
                                     [Replicate(), Shard(0)])}
    shards = {"hand/w": asyncckpt.ShardMetadata(global_shape=HAND, offsets=(r0, 0))}
    root = Path(ctx.args["root"])
    with asyncckpt.AsyncCheckpointer(root / "matrix", timeout_s=30, block_bytes=BLOCK) as ck:
        info = ck.save_async(state, STEP, shards=shards).wait()
        assert info.step == STEP
        assert ck.steps() == [STEP]
    # Many equal replicated tensors: the writes should be spread evenly over the ranks.
    spread = {f"r{i}": full_tensor(f"spread/{i}", SPREAD_SHAPE) for i in range(SPREAD)}
    with asyncckpt.AsyncCheckpointer(root / "spread", timeout_s=30) as ck:
        ck.save(spread, 1)
    return {"rank": rank}


def _manifest_json(step_dir: Path) -> dict[str, Any]:
    return long_entries(json.loads((step_dir / "manifest.json").read_text()))


# --- the load spawn ----------------------------------------------------------------------------

def _load_target(world: int, rank: int, mesh: Any, lp: str, src: int
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch
    dt = dtensor_api()
    Replicate, Shard = dt.Replicate, dt.Shard

    c0, nc = _hand_cols(world, rank)
    target: dict[str, Any] = {
        "dt": {p: {d: _dt(f"dt/{p}/{d}", SHAPE, d, mesh, [_placement(lp)], zero=True)
                   for d in DTYPES} for p in PLACES},
        "vec": _dt("vec", VEC, "float64", mesh, [Shard(0)], zero=True),
        "big": _dt("big", BIG, "float32", mesh, [Replicate()], zero=True),
        "plain": {"a": torch.zeros(3, 4, dtype=torch.int32),
                  "b": torch.zeros(16, dtype=torch.float16)},
        "hand": {"w": torch.zeros(HAND[0], nc)},
        "meta": {"epoch": 0, "name": "", "lr": 0.0, "nothing": 1, "flags": [], "pair": (),
                 "blob": b"", "saved_by": 0},
    }
    if src == 4:
        target["mesh2d"] = {k: _dt(f"mesh2d/{k}", SHAPE, "float32", mesh, [Shard(1)], zero=True)
                            for k in ("ss", "rs")}
    shards = {"hand/w": asyncckpt.ShardMetadata(global_shape=HAND, offsets=(0, c0))}
    return target, shards


def _check_loaded(c: dict[str, Checks], out: dict[str, Any], target: dict[str, Any],
                  mesh: Any, lp: str, src: int, world: int, rank: int) -> None:
    import torch
    dt = dtensor_api()
    Shard = dt.Shard

    def want_local(name: str, shape: tuple[int, ...], dtype: str, placements: list[Any]) -> Any:
        full = full_tensor(name, shape, _dtype(dtype))
        return distribute_locally(full, mesh, placements).to_local()

    c["load"].check(out is target, "load(state) did not return the state it was given")
    for p in PLACES:
        for d in DTYPES:
            got = out["dt"][p][d]
            c["dtensor"].check(got is target["dt"][p][d],
                               f"saved {p} -> loaded {lp} {d}: DTensor not loaded in place")
            want = want_local(f"dt/{p}/{d}", SHAPE, d, [_placement(lp)])
            c["dtensor"].check(same_bits(got.to_local(), want),
                               f"saved {p} -> loaded {lp} {d}: local shard differs")
    c["dtensor"].check(same_bits(out["vec"].to_local(),
                                 want_local("vec", VEC, "float64", [Shard(0)])),
                       f"vec (loaded {lp}): local shard differs")
    c["dtensor"].check(same_bits(out["big"].to_local(), full_tensor("big", BIG)),
                       f"big (loaded {lp}): differs")
    c["plain"].check(same_bits(out["plain"]["a"], full_tensor("plain/a", (3, 4), torch.int32)),
                     f"plain/a (pass {lp}) differs")
    c["plain"].check(same_bits(out["plain"]["b"], full_tensor("plain/b", (16,), torch.float16)),
                     f"plain/b (pass {lp}) differs")
    c0, nc = _hand_cols(world, rank)
    c["hand"].check(same_bits(out["hand"]["w"], full_tensor("hand/w", HAND)[:, c0:c0 + nc]),
                    f"hand/w columns {c0}:{c0 + nc} (pass {lp}) differ")
    want_meta = {**META, "saved_by": src}
    c["meta"].check(repr(out["meta"]) == repr(want_meta),
                    f"meta (pass {lp}): {out['meta']!r} != {want_meta!r}")
    if src == 4:
        for k in ("ss", "rs"):
            want = want_local(f"mesh2d/{k}", SHAPE, "float32", [Shard(1)])
            c["mesh2d"].check(same_bits(out["mesh2d"][k].to_local(), want),
                              f"mesh2d/{k} (2-D mesh) -> Shard(1) on {world}: local differs")


@contextlib.contextmanager
def _counting_reads() -> Iterator[list[int]]:
    """Count the bytes LocalStorage.pread_into reads meanwhile (in every thread)."""
    from asyncckpt.storage import LocalStorage

    counted: list[int] = []
    lock = threading.Lock()
    orig = LocalStorage.pread_into

    def counting(self: Any, fd: int, views: Any, offset: int) -> int:
        n = orig(self, fd, views, offset)
        with lock:
            counted.append(n)
        return n

    LocalStorage.pread_into = counting  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        LocalStorage.pread_into = orig  # type: ignore[method-assign]


def load_worker(ctx: RankCtx) -> dict[str, Any]:
    Shard = dtensor_api().Shard

    world, rank = ctx.world, ctx.rank
    mesh, _ = _meshes(world)
    results: dict[str, Any] = {}
    for src, root in sorted(ctx.args["sources"].items()):
        src = int(src)
        c = {k: Checks() for k in ("load", "dtensor", "plain", "hand", "meta", "mesh2d",
                                   "bytes")}
        with asyncckpt.AsyncCheckpointer(Path(root) / "matrix", timeout_s=30) as ck:
            for lp in PLACES:
                target, shards = _load_target(world, rank, mesh, lp, src)
                out = c["load"].run(f"load into {lp}", ck.load, target, shards=shards)
                if out is not None:
                    _check_loaded(c, out, target, mesh, lp, src, world, rank)
            # A rank that wants a Shard(0) slice of the one-chunk "big" reads about its
            # slice (whole checksum blocks), not the tensor.
            big = _dt("big", BIG, "float32", mesh, [Shard(0)], zero=True)
            with _counting_reads() as counted:
                c["bytes"].run("partial load", ck.load, {"big": big}, strict=False)
            full = _dt("big", BIG, "float32", mesh, [Shard(0)])
            c["bytes"].check(same_bits(big.to_local(), full.to_local()),
                             "big Shard(0) slice differs")
            read, local = sum(counted), big.to_local().numel() * 4
        results[str(src)] = {k: v.failures for k, v in c.items()}
        results[str(src)]["bytes_read"] = read
        results[str(src)]["local_bytes"] = local
    return results


# --- the spawns, shared by the tests ----------------------------------------------------------

class Spawns:
    """Runs each save world and each load world once, on first use."""

    def __init__(self, base: Path):
        self.base = base
        self.saved: dict[int, Path] = {}
        self.loaded: dict[int, dict[int, dict[str, Any]]] = {}

    def save(self, world: int) -> Path:
        if world not in self.saved:
            root = self.base / f"saved_by_{world}"
            run_ranks(MODULE, "save_worker", world, self.base / f"run_save_{world}",
                      args={"root": str(root)})
            self.saved[world] = root
        return self.saved[world]

    def load(self, world: int) -> dict[int, dict[str, Any]]:
        if world not in self.loaded:
            sources = {src: str(self.save(src)) for src, dst in PAIRS if dst == world}
            runs = run_ranks(MODULE, "load_worker", world, self.base / f"run_load_{world}",
                             args={"sources": sources})
            merged: dict[int, dict[str, Any]] = {}
            for rank, run in sorted(runs.items()):
                for src, res in run.result.items():
                    m = merged.setdefault(int(src), {"ranks": {}})
                    m["ranks"][rank] = res
                    for k, v in res.items():
                        if isinstance(v, list):
                            m.setdefault(k, []).extend(f"rank {rank}: {x}" for x in v)
            self.loaded[world] = merged
        return self.loaded[world]


@pytest.fixture(scope="module")
def spawns(tmp_path_factory: pytest.TempPathFactory) -> Spawns:
    return Spawns(tmp_path_factory.mktemp("dist_matrix"))


def _pair_id(pair: tuple[int, int]) -> str:
    return f"{pair[0]}to{pair[1]}"


def _load_whole_in_process(root: Path, src: int) -> dict[str, list[str]]:
    """Load world 1: this (pytest) process, no process group, whole tensors."""
    import torch

    c = {k: Checks() for k in ("load", "dtensor", "plain", "hand", "meta", "mesh2d")}
    step_root = root / "matrix"
    tree = c["load"].run("asyncckpt.load", asyncckpt.load, step_root)
    target: dict[str, Any] = {
        "dt": {p: {d: torch.zeros(SHAPE, dtype=_dtype(d)) for d in DTYPES} for p in PLACES},
        "vec": torch.zeros(VEC, dtype=torch.float64), "big": torch.zeros(BIG),
        "plain": {"a": torch.zeros(3, 4, dtype=torch.int32),
                  "b": torch.zeros(16, dtype=torch.float16)},
        "hand": {"w": torch.zeros(HAND)},
        "meta": {k: None for k in [*META, "saved_by"]},
    }
    if src == 4:
        target["mesh2d"] = {"ss": torch.zeros(SHAPE), "rs": torch.zeros(SHAPE)}
    ck = asyncckpt.AsyncCheckpointer(step_root)
    into = c["load"].run("load(state)", ck.load, target)
    for what, out in (("asyncckpt.load", tree), ("load(state)", into)):
        if out is None:
            continue
        for p in PLACES:
            for d in DTYPES:
                c["dtensor"].check(same_bits(out["dt"][p][d],
                                             full_tensor(f"dt/{p}/{d}", SHAPE, _dtype(d))),
                                   f"{what}: dt/{p}/{d} differs")
        c["dtensor"].check(same_bits(out["vec"], full_tensor("vec", VEC, torch.float64)),
                           f"{what}: vec differs")
        c["dtensor"].check(same_bits(out["big"], full_tensor("big", BIG)), f"{what}: big differs")
        c["plain"].check(same_bits(out["plain"]["a"], full_tensor("plain/a", (3, 4),
                                                                  torch.int32)),
                         f"{what}: plain/a differs")
        c["plain"].check(same_bits(out["plain"]["b"], full_tensor("plain/b", (16,),
                                                                  torch.float16)),
                         f"{what}: plain/b differs")
        c["hand"].check(same_bits(out["hand"]["w"], full_tensor("hand/w", HAND)),
                        f"{what}: hand/w differs")
        want_meta = {**META, "saved_by": src}
        c["meta"].check(repr(out["meta"]) == repr(want_meta),
                        f"{what}: meta {out['meta']!r} != {want_meta!r}")
        if src == 4:
            for k in ("ss", "rs"):
                c["mesh2d"].check(same_bits(out["mesh2d"][k], full_tensor(f"mesh2d/{k}", SHAPE)),
                                  f"{what}: mesh2d/{k} (saved on a 2x2 mesh) differs")
    c["load"].check(into is None or into is target, "load(state) returned another object")
    return {k: v.failures for k, v in c.items()}


@pytest.fixture(scope="module")
def loaded(spawns: Spawns) -> Any:
    def get(pair: tuple[int, int]) -> dict[str, Any]:
        src, dst = pair
        if dst == 1:
            return _load_whole_in_process(spawns.save(src), src)
        return spawns.load(dst)[src]
    return get


# --- the matrix --------------------------------------------------------------------------------

@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_dtensor_placements_reshard_bit_exact(loaded: Any, pair: tuple[int, int]) -> None:
    """Shard(0)/Shard(1)/Replicate() saved x Shard(0)/Shard(1)/Replicate() loaded."""
    res = loaded(pair)
    assert res["load"] == [], "\n".join(res["load"])
    assert res["dtensor"] == [], "\n".join(res["dtensor"])


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_plain_replicated_tensors(loaded: Any, pair: tuple[int, int]) -> None:
    res = loaded(pair)
    assert res["load"] == [], "\n".join(res["load"])
    assert res["plain"] == [], "\n".join(res["plain"])


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_hand_sharded_rows_to_columns(loaded: Any, pair: tuple[int, int]) -> None:
    """ShardMetadata: saved row-split over N ranks, loaded column-split over M (or whole)."""
    res = loaded(pair)
    assert res["load"] == [], "\n".join(res["load"])
    assert res["hand"] == [], "\n".join(res["hand"])


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_non_tensor_leaves(loaded: Any, pair: tuple[int, int]) -> None:
    res = loaded(pair)
    assert res["load"] == [], "\n".join(res["load"])
    assert res["meta"] == [], "\n".join(res["meta"])


@pytest.mark.parametrize("pair", [(4, 2), (4, 1)], ids=_pair_id)
def test_2d_mesh_saved_loaded_1d_or_whole(loaded: Any, pair: tuple[int, int]) -> None:
    """[Shard(0), Shard(1)] and [Replicate(), Shard(0)] on a 2x2 mesh -> [Shard(1)] / whole."""
    res = loaded(pair)
    assert res["load"] == [], "\n".join(res["load"])
    assert res["mesh2d"] == [], "\n".join(res["mesh2d"])


@pytest.mark.parametrize("pair", [p for p in PAIRS if p[1] > 1], ids=_pair_id)
def test_rank_reads_only_its_byte_ranges(loaded: Any, pair: tuple[int, int]) -> None:
    res = loaded(pair)
    assert res["bytes"] == [], "\n".join(res["bytes"])
    full = BIG[0] * BIG[1] * 4
    for rank, r in res["ranks"].items():
        # whole checksum blocks around the rank's rows, never the whole tensor
        assert r["bytes_read"] >= r["local_bytes"], (rank, r["bytes_read"])
        assert r["bytes_read"] <= r["local_bytes"] + 2 * BLOCK, (rank, r["bytes_read"])
        assert r["bytes_read"] < 0.7 * full, (rank, r["bytes_read"])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_manifest_lists_world_and_rank_files(spawns: Spawns, world: int) -> None:
    step_dir = spawns.save(world) / "matrix" / f"step_{STEP:09d}"
    m = _manifest_json(step_dir)
    assert m["world_size"] == world
    names = {f"rank_{r:05d}.safetensors" for r in range(world)}
    assert set(m["files"]) == names, m["files"]
    on_disk = {p.name for p in step_dir.iterdir()}
    assert on_disk == names | {"manifest.json"}, on_disk
    for name in names:
        assert (step_dir / name).stat().st_size == m["files"][name]["bytes"]
    tensors = m["tensors"]

    def chunks(key: str) -> list[dict[str, Any]]:
        return tensors[key]["chunks"]

    # replicated data appears once; sharded data once per shard
    for key in ("dt/R/float32", "dt/R/bfloat16", "big", "plain/a", "plain/b"):
        assert len(chunks(key)) == 1, (key, chunks(key))
    for d in DTYPES:
        assert len(chunks(f"dt/S0/{d}")) == world
        assert len(chunks(f"dt/S1/{d}")) == world
    assert len(chunks("hand/w")) == world
    if world == 4:
        assert len(chunks("mesh2d/ss")) == 4
        assert len(chunks("mesh2d/rs")) == 2  # each box is held by two ranks, written once
    assert not [p for p in (spawns.save(world) / "matrix").iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_replicated_writes_spread_over_ranks(spawns: Spawns, world: int) -> None:
    step_dir = spawns.save(world) / "spread" / "step_000000001"
    m = _manifest_json(step_dir)
    assert all(len(t["chunks"]) == 1 for t in m["tensors"].values())
    writers = {}
    for key, t in m["tensors"].items():
        writers.setdefault(t["chunks"][0]["file"], []).append(key)
    sizes = {name: (step_dir / name).stat().st_size for name in m["files"]}
    assert len(sizes) == world, sizes
    per_rank = [len(v) for v in writers.values()]
    assert max(per_rank) - min(per_rank) <= 1, writers
    assert max(sizes.values()) <= 1.25 * min(sizes.values()), sizes
    loaded = asyncckpt.load(step_dir)
    for i in range(SPREAD):
        assert same_bits(loaded[f"r{i}"], full_tensor(f"spread/{i}", SPREAD_SHAPE))


# --- async behaviour under distribution --------------------------------------------------------

def _mutation(ctx: RankCtx, mesh: Any, root: Path, c: Checks) -> None:
    import torch
    Shard = dtensor_api().Shard

    for overlap in (True, False):
        sub = root / f"mutation_overlap_{overlap}"
        with asyncckpt.AsyncCheckpointer(sub, mode="async", timeout_s=20) as ck:
            w = _dt("m/w", (512, 33), "float32", mesh, [Shard(0)])
            p = full_tensor("m/p", (50_000,)).clone()
            state = {"w": w, "p": p, "step": 1}
            fut = ck.save_async(state, 1, overlap=overlap)
            fut.wait_staged()
            with torch.no_grad():  # the next optimizer step
                w.to_local().fill_(123.0)
                p.fill_(-1.0)
            state["step"] = 2
            c.check(bool((w.to_local() == 123.0).all()), "the mutation did not reach w")
            fut.wait()
            got = ck.load()
            c.check(same_bits(got["w"], full_tensor("m/w", (512, 33))),
                    f"overlap={overlap}: saved w is not the pre-mutation value")
            c.check(same_bits(got["p"], full_tensor("m/p", (50_000,))),
                    f"overlap={overlap}: saved p is not the pre-mutation value")
            c.check(got["step"] == 1, f"overlap={overlap}: step {got['step']!r}")


def _recording_storage() -> Any:
    from asyncckpt.storage import LocalStorage

    class Recording(LocalStorage):
        """LocalStorage that records renames and removals."""

        def __init__(self) -> None:
            self.calls: list[tuple[str, str, str]] = []

        def rename(self, src: Path, dst: Path) -> None:
            self.calls.append(("rename", Path(src).name, Path(dst).name))
            super().rename(src, dst)

        def remove_tree(self, path: Path) -> None:
            self.calls.append(("remove_tree", Path(path).name, ""))
            super().remove_tree(path)

    return Recording()


def _retention(ctx: RankCtx, mesh: Any, root: Path, c: Checks) -> None:
    dt = dtensor_api()
    Replicate, Shard = dt.Replicate, dt.Shard

    storage = _recording_storage()
    with asyncckpt.AsyncCheckpointer(root / "retention", keep_last=2, timeout_s=20,
                                     storage=storage) as ck:
        plans = []
        for step in (1, 2, 3, 4):
            state = {"w": _dt(f"k{step}/w", (12, 5), "float32", mesh, [Shard(1)]),
                     "r": _dt(f"k{step}/r", (7,), "float32", mesh, [Replicate()]),
                     "p": full_tensor(f"k{step}/p", (9,)), "step": step}
            info = ck.save(state, step)
            c.check(info.step == step, f"info.step {info.step} != {step}")
            plans.append(getattr(ck, "_plan", None))
            ck.wait()  # and its retention: save() returns once the step is durable
            ctx.barrier()  # the coordinator has applied retention
            want = list(range(max(1, step - 1), step + 1))
            c.check(ck.steps() == want, f"after step {step}: steps {ck.steps()} != {want}")
            ctx.barrier()
        # the same layout four times: one plan, and every save correct
        if plans[0] is not None:
            c.check(all(p is plans[0] for p in plans), "the write plan was rebuilt")
        for step in (3, 4):
            got = ck.load(step=step)
            for k, shape in (("w", (12, 5)), ("r", (7,)), ("p", (9,))):
                c.check(same_bits(got[k], full_tensor(f"k{step}/{k}", shape)),
                        f"step {step}: {k} differs")
            c.check(got["step"] == step, f"step {step}: step leaf {got['step']!r}")
    deleting = [x for x in storage.calls if x[0] == "rename" and ".deleting-" in x[2]]
    if ctx.rank == 0:
        c.check(sorted(x[1] for x in deleting) == ["step_000000001", "step_000000002"],
                f"coordinator's retention renames: {deleting}")
    else:
        c.check(deleting == [] and not [x for x in storage.calls if x[0] == "remove_tree"],
                f"rank {ctx.rank} deleted something: {storage.calls}")
    left = sorted(p.name for p in (root / "retention").iterdir() if not p.name.startswith(".a"))
    c.check(left == ["step_000000003", "step_000000004"], f"left on disk: {left}")


def _milestones_and_model_alone(ctx: RankCtx, mesh: Any, root: Path, c: Checks) -> None:
    """keep_every in a group (the coordinator's retention spares the milestones), and a
    load of the model alone, resharded, from a checkpoint that also holds optimizer
    state (ignore_unexpected)."""
    dt = dtensor_api()
    Shard = dt.Shard

    with asyncckpt.AsyncCheckpointer(root / "milestones", keep_last=1, keep_every=2,
                                     timeout_s=20) as ck:
        for step in (1, 2, 3, 4, 5):
            state = {"model": {"w": _dt(f"m{step}/w", (12, 6), "float32", mesh, [Shard(0)])},
                     "optim": {"m": _dt(f"m{step}/m", (12, 6), "float32", mesh, [Shard(0)])},
                     "step": step}
            ck.save(state, step)
            ck.wait()  # and its retention
            ctx.barrier()
            want = [s for s in range(1, step + 1) if s == step or s % 2 == 0]
            c.check(ck.steps() == want, f"after step {step}: steps {ck.steps()} != {want}")
            ctx.barrier()
        target = {"model": {"w": _dt("m4/w", (12, 6), "float32", mesh, [Shard(1)], zero=True)}}
        try:
            ck.load(target, step=4)
            c.check(False, "a strict load of the model alone did not raise")
        except asyncckpt.StateMismatchError as exc:
            c.check(exc.unexpected == ["optim/m"], f"unexpected: {exc.unexpected}")
        w = target["model"]["w"]
        out = ck.load(target, step=4, ignore_unexpected=True)
        c.check(out["model"]["w"] is w, "the DTensor was replaced")
        c.check(same_bits(w.full_tensor(), full_tensor("m4/w", (12, 6))),
                "the model's resharded values differ")
        # what the target lacks is skipped, values too (a model-only target gets no "step")
        c.check(set(out) == {"model"}, f"the rest of the tree: {out}")


def _layout_change(ctx: RankCtx, mesh: Any, root: Path, c: Checks) -> None:
    import torch
    Shard = dtensor_api().Shard

    with asyncckpt.AsyncCheckpointer(root / "layout", timeout_s=20) as ck:
        expect: dict[int, dict[str, Any]] = {}
        for step in (1, 2, 3, 4):
            state: dict[str, Any] = {
                "a": _dt(f"l{step}/a", (8, 6), "float32", mesh, [Shard(0)]),
                "b": full_tensor(f"l{step}/b", (5,), torch.float64),
            }
            want = {"a": full_tensor(f"l{step}/a", (8, 6)),
                    "b": full_tensor(f"l{step}/b", (5,), torch.float64)}
            if step == 2:  # a new key on every rank
                state["c"] = _dt("l2/c", (6, 10), "bfloat16", mesh, [Shard(1)])
                want["c"] = full_tensor("l2/c", (6, 10), torch.bfloat16)
            if step == 3 and ctx.rank == 1:  # a new key on one rank only
                state["only1"] = full_tensor("l3/only1", (4,), torch.int16)
            if step == 3:
                want["only1"] = full_tensor("l3/only1", (4,), torch.int16)
            expect[step] = want
            ck.save(state, step)
        for step, want in expect.items():
            got = ck.load(step=step)
            c.check(sorted(got) == sorted(want), f"step {step}: keys {sorted(got)}")
            for k, v in want.items():
                c.check(k in got and same_bits(got[k], v), f"step {step}: {k} differs")
        # Same keys, dtypes and local shapes, other boxes: "h" is replicated whole in
        # step 5 (one rank writes it) and split by rows in step 6 (each rank writes its
        # half). Reusing step 5's layout for step 6 would leave half of "h" unwritten.
        for step, glob in ((5, (4, 3)), (6, (8, 3))):
            h = full_tensor(f"l{step}/h", glob)
            row = 0 if glob[0] == 4 else 4 * ctx.rank
            ck.save({"h": h[row:row + 4].clone()}, step, shards={
                "h": asyncckpt.ShardMetadata(global_shape=glob, offsets=(row, 0))})
            got = ck.load(step=step)
            c.check(same_bits(got["h"], h), f"step {step}: h differs")
        # step 2 again, resharded into the current ranks as Shard(1) / Shard(0)
        tgt = {"a": _dt("x", (8, 6), "float32", mesh, [Shard(1)], zero=True),
               "b": torch.zeros(5, dtype=torch.float64),
               "c": _dt("x", (6, 10), "bfloat16", mesh, [Shard(0)], zero=True)}
        ck.load(tgt, step=2)

        for k, p in (("a", Shard(1)), ("c", Shard(0))):
            want_local = distribute_locally(expect[2][k], mesh, [p]).to_local()
            c.check(same_bits(tgt[k].to_local(), want_local), f"step 2 {k} resharded differs")


def _store_keys(ctx: RankCtx, mesh: Any, root: Path, c: Checks) -> None:
    """How many keys the job's Store holds after 2 and after 12 saves (rank 0 reports)."""
    from torch.distributed import distributed_c10d as c10d
    Shard = dtensor_api().Shard

    store = c10d._get_default_store()
    counts = []
    with asyncckpt.AsyncCheckpointer(root / "store_keys", timeout_s=20) as ck:
        for step in range(1, 13):
            if step > 2:  # and a save that fails before the layout exchange, on one rank
                bad = {"step": step, **({"bad": object()} if ctx.rank == 1 else {})}
                try:
                    ck.save(bad, 100 + step)
                    c.check(False, f"the save of step {100 + step} did not fail")
                except asyncckpt.CheckpointError:
                    pass
            ck.save({"w": _dt("s/w", (8, 4), "float32", mesh, [Shard(0)]), "step": step}, step)
            if step in (2, 12):
                ctx.barrier()
                counts.append(store.num_keys())
    c.check(len(counts) == 2, f"counts {counts}")
    if ctx.rank == 0:
        c.failures.append(f"keys: {counts[0]} {counts[1]}")  # read by the test, not a failure


def _early_manifest(ctx: RankCtx, mesh: Any, root: Path, c: Checks) -> None:
    """The coordinator merges the manifest while a peer's shard file is still being
    written; a peer whose write then fails still leaves nothing committed."""
    Shard = dtensor_api().Shard

    from asyncckpt.storage import LocalStorage

    class Slow(LocalStorage):
        """Rank 1's shard write starts 1.5 s late (and fails when asked); rank 0 notes
        which files were in the directory when it wrote the manifest."""

        def __init__(self) -> None:
            self.fail = False
            self.seen: list[list[str]] = []

        def write_arena(self, path: Path, *a: Any, **kw: Any) -> None:
            if ctx.rank == 1:
                time.sleep(1.5)
                if self.fail:
                    raise OSError(errno.EIO, "injected late write failure")
            super().write_arena(path, *a, **kw)

        def write_bytes(self, path: Path, data: bytes) -> None:
            if Path(path).name == "manifest.json":
                self.seen.append(sorted(p.name for p in Path(path).parent.iterdir()))
            super().write_bytes(path, data)

    storage = Slow()
    sub = root / "early_manifest"
    with asyncckpt.AsyncCheckpointer(sub, mode="async", timeout_s=20, storage=storage) as ck:
        state = {"w": _dt("e/w", (64, 8), "float32", mesh, [Shard(0)]), "step": 1}
        ck.save(state, 1)
        got = ck.load(step=1)
        c.check(same_bits(got["w"], full_tensor("e/w", (64, 8))), "step 1: w differs")
        storage.fail = True
        t0 = time.monotonic()
        try:
            ck.save(state, 2)
            c.check(False, "step 2 was committed although rank 1's write failed")
        except asyncckpt.CheckpointError as exc:
            c.check("rank 1" in str(exc), f"the error does not name rank 1: {exc}")
            c.check(time.monotonic() - t0 < 10, f"failing took {time.monotonic() - t0:.1f}s")
        ctx.barrier()
        c.check(ck.steps() == [1], f"steps {ck.steps()} != [1]")
        left = [p.name for p in sub.iterdir() if ".tmp-" in p.name]
        c.check(left == [], f"temporary dirs left: {left}")
        # The coordinator holds no tensor at all: it merges after the writes instead.
        storage.fail = False
        only = full_tensor("e/only1", (100,))
        ck.save({"step": 3, **({"only1": only} if ctx.rank == 1 else {})}, 3)
        got = ck.load(step=3)
        c.check(got["step"] == 3 and "only1" in got and same_bits(got["only1"], only),
                f"step 3 loaded as {got}")
    if ctx.rank == 0:
        # The first two manifests (the committed one and the aborted one) were written
        # before rank 1's shard file existed: the merge waited for its record, not its
        # write. The third, with nothing hashed on the coordinator, after it.
        seen = storage.seen
        c.check(len(seen) == 3 and all("rank_00001.safetensors" not in s for s in seen[:2])
                and "rank_00001.safetensors" in seen[2],
                f"files beside the manifest when it was written: {seen}")


def _tree_edge_cases(ctx: RankCtx, mesh: Any, root: Path, c: Checks) -> None:
    """Tied DTensors where one rank's shard is empty; ranks whose trees disagree; a
    DTensor on a mesh without this rank; leaves aliasing one memory as different
    global tensors."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    dt = dtensor_api()
    DTensor, Shard = dt.DTensor, dt.Shard

    with asyncckpt.AsyncCheckpointer(root / "edge", timeout_s=20) as ck:
        # (1, 3) over 2 ranks: rank 1's local shard is empty
        d = distribute_locally(full_tensor("edge/tied", (1, 3)), mesh, [Shard(0)])
        ck.save({"embed": d, "lm_head": d}, 1)  # one object at two paths
        ck.save({"embed": d.detach(), "lm_head": d.detach()}, 2)  # two views (state_dict)
        for step in (1, 2):
            got = ck.load(step=step)
            c.check(got["lm_head"] is got["embed"], f"step {step}: the tie was lost")
            c.check(same_bits(got["embed"], full_tensor("edge/tied", (1, 3))),
                    f"step {step}: values differ")
        # a list of another length on rank 1: refused, on every rank, nothing committed
        lst = [full_tensor("edge/l0", (4,))] + ([full_tensor("edge/l1", (4,))]
                                                 if ctx.rank == 1 else [])
        try:
            ck.save({"lst": lst}, 3)
            c.check(False, "a save whose ranks' trees disagree was committed")
        except asyncckpt.CheckpointError as exc:
            c.check("state trees disagree" in str(exc), f"unclear error: {exc}")
        ctx.barrier()
        c.check(ck.steps() == [1, 2], f"steps {ck.steps()}")
        # a DTensor on a mesh of rank 0 only
        sub = DeviceMesh("cpu", [0])
        w = distribute_locally(full_tensor("edge/w", (4, 3)), sub, [Shard(0)])
        try:
            ck.save({"w": w}, 4)
            c.check(False, "a DTensor on a mesh without rank 1 was saved")
        except asyncckpt.CheckpointError as exc:
            if ctx.rank == 1:
                c.check("does not include this rank" in str(exc), f"unclear error: {exc}")
        ctx.barrier()
        # leaves sharing one local memory but standing for different global tensors
        local = full_tensor(f"edge/local{ctx.rank}", (2, 3))
        alias = {"plain": local,
                 "rows": DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
                 "cols": DTensor.from_local(local, mesh, [Shard(1)], run_check=False)}
        ck.save(alias, 5)
        got = ck.load(step=5)
        mine = full_tensor(f"edge/local{ctx.rank}", (2, 3))
        both = [full_tensor(f"edge/local{r}", (2, 3)) for r in range(ctx.world)]
        c.check(same_bits(got["rows"], torch.cat(both, 0)), f"rows: {list(got['rows'].shape)}")
        c.check(same_bits(got["cols"], torch.cat(both, 1)), f"cols: {list(got['cols'].shape)}")
        c.check(ctx.rank != 0 or same_bits(got["plain"], mine), "plain: rank 0's values differ")


def _per_rank_rng(ctx: RankCtx, mesh: Any, root: Path, c: Checks) -> None:
    """RNGState keeps every rank's generators, and each rank gets its own back."""
    import random

    import numpy as np
    import torch

    def draw() -> list[float]:
        return [random.random(), float(np.random.rand()), float(torch.rand(()))]

    def seed(n: int) -> None:
        random.seed(n)
        np.random.seed(n)
        torch.manual_seed(n)

    seed(100 + ctx.rank)
    with asyncckpt.AsyncCheckpointer(root / "rng", timeout_s=20) as ck:
        ck.save({"rng": asyncckpt.RNGState()}, 1)
        want = draw()
        seed(7)  # the same on every rank
        ck.load({"rng": asyncckpt.RNGState()})
        c.check(draw() == want, "this rank's generators did not come back")


def _fsdp_optimizer_passed_directly(ctx: RankCtx, mesh: Any, root: Path, c: Checks) -> None:
    """A fresh FSDP2 optimizer passed as it is: a clear error before any byte is read,
    not whole plain tensors that fail at its next step()."""
    import torch
    fully_shard = fully_shard_fn()

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)),
                            mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, opt = build()
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    said: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("asyncckpt").addHandler(catch)
    try:
        with asyncckpt.AsyncCheckpointer(root / "fsdp_direct", timeout_s=20) as ck:
            ck.save({"model": model, "optim": opt}, 1)
            ck.save({"model": model, "optim": opt}, 2)
    finally:
        logging.getLogger("asyncckpt").removeHandler(catch)
    # told at the first save (rank 0 alone), not when the resume fails
    told = [m for m in said if "saving the optimizer object at 'optim' of a model with "
            "DTensor parameters" in m and "get_state_dict(model, optim)[1]" in m]
    c.check(len(told) == (1 if ctx.rank == 0 else 0), f"warned {len(told)} times: {said}")
    with asyncckpt.AsyncCheckpointer(root / "fsdp_direct", timeout_s=20) as ck:
        model2, opt2 = build()
        before = [p.to_local().clone() for p in model2.parameters()]
        try:
            ck.load({"model": model2, "optim": opt2})
            c.check(False, "a fresh FSDP2 optimizer was loaded with plain tensors")
        except asyncckpt.StateMismatchError as exc:
            # (a DCP trial followed "load into get_state_dict(...)[1]" into missing and
            # unexpected keys: saved as the object, the moments are keyed by index)
            c.check("DTensor parameters" in str(exc) and "call get_state_dict(model, optim) "
                    "once before the load" in str(exc), f"unclear error: {exc}")
        c.check(all(torch.equal(a, p.to_local()) for a, p in zip(before, model2.parameters(),
                                                                  strict=True)),
                "the model was changed by a load that was refused")
        # the advice, followed, loads the moments exactly
        from torch.distributed.checkpoint.state_dict import get_state_dict
        get_state_dict(model2, opt2)
        ck.load({"model": model2, "optim": opt2})
        for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
            for name in ("exp_avg", "exp_avg_sq"):
                c.check(torch.equal(opt.state[p][name].to_local(),
                                    opt2.state[p2][name].to_local()),
                        f"{name} did not come back")


def _wrapper_type() -> type:
    """A wrapper tensor subclass, as torchao's Float8 and NF4 tensors are: no memory of its
    own (data_ptr() is 0); its ops run on the plain tensor it wraps."""
    import torch
    from torch.utils._pytree import tree_map

    class Wrapped(torch.Tensor):
        inner: torch.Tensor

        @staticmethod
        def __new__(cls, inner: torch.Tensor) -> Any:
            t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                    strides=inner.stride())
            t.inner = inner
            return t

        def __tensor_flatten__(self) -> tuple[list[str], None]:
            return ["inner"], None

        @staticmethod
        def __tensor_unflatten__(inner: dict[str, Any], meta: Any, size: Any,
                                 stride: Any) -> Any:
            return Wrapped(inner["inner"])

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*tree_map(lambda x: x.inner if isinstance(x, Wrapped) else x, args),
                       **tree_map(lambda x: x.inner if isinstance(x, Wrapped) else x,
                                  kwargs or {}))
            return tree_map(lambda x: Wrapped(x) if type(x) is torch.Tensor else x, out)

    return Wrapped


def _wrapper_locals(ctx: RankCtx, mesh: Any, root: Path, c: Checks) -> None:
    """A DTensor whose local shard is a wrapper subclass (FSDP2 over torchao's Float8 or
    NF4): refused naming its path, on save and as a load target. The save crashed the
    process (a copy from address 0); the load read into address 0 and blamed a
    read-only mapping."""
    import torch
    dt = dtensor_api()
    DTensor, Shard = dt.DTensor, dt.Shard

    wrapped = _wrapper_type()
    with asyncckpt.AsyncCheckpointer(root / "wrapper", timeout_s=20) as ck:
        local = full_tensor(f"wrap/{ctx.rank}", (2, 3))
        dt = DTensor.from_local(wrapped(local), mesh, [Shard(0)], run_check=False)
        c.check(dt._local_tensor.data_ptr() == 0, "the local shard has memory of its own")
        try:
            ck.save({"x": {"w": dt}}, 1)
            c.check(False, "a DTensor with a wrapper-subclass local shard was saved")
        except asyncckpt.UnsupportedLeafError as exc:
            c.check("'x/w'" in str(exc) and "no memory of its own" in str(exc),
                    f"unclear error: {exc}")
        ctx.barrier()
        plain = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        ck.save({"x": {"w": plain}}, 2)
        target = DTensor.from_local(wrapped(torch.zeros(2, 3)), mesh, [Shard(0)],
                                    run_check=False)
        try:
            ck.load({"x": {"w": target}}, step=2)
            c.check(False, "loaded into a DTensor with a wrapper-subclass local shard")
        except asyncckpt.UnsupportedLeafError as exc:
            c.check("'x/w'" in str(exc) and "no memory of its own" in str(exc),
                    f"unclear error: {exc}")
        c.check(ck.steps() == [2], f"steps {ck.steps()}")


def _differing_replicated_dtensor(ctx: RankCtx, mesh: Any, root: Path, c: Checks) -> None:
    """A Replicate() DTensor whose ranks hold different values is saved once, from one
    rank: the coordinator warns, as it does for a plain tensor (it said nothing)."""
    import io
    import logging

    import torch
    dt = dtensor_api()
    DTensor, Replicate = dt.DTensor, dt.Replicate

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logging.getLogger("asyncckpt").addHandler(handler)
    try:
        with asyncckpt.AsyncCheckpointer(root / "replicas", timeout_s=20) as ck:
            ck.save({"differ": DTensor.from_local(torch.full((3,), float(ctx.rank)), mesh,
                                                  [Replicate()], run_check=False),
                     "same": DTensor.from_local(torch.ones(3), mesh, [Replicate()],
                                                run_check=False)}, 1)
    finally:
        logging.getLogger("asyncckpt").removeHandler(handler)
    if ctx.rank == 0:  # the coordinator merges the records, and warns
        said = buf.getvalue()
        c.check("different values of tensor(s) 'differ'" in said and "'same'" not in said,
                f"the coordinator logged: {said!r}")
    # strict_replicas=True: the save fails on every rank, a replica of any size compared
    big = torch.zeros(1 << 16)
    big[-1] = ctx.rank
    with asyncckpt.AsyncCheckpointer(root / "strict", timeout_s=20,
                                     strict_replicas=True) as ck:
        try:
            ck.save({"big": DTensor.from_local(big, mesh, [Replicate()], run_check=False)}, 1)
            c.check(False, "a save of differing replicas was committed")
        except asyncckpt.CheckpointSaveError as exc:
            c.check("strict_replicas=True" in str(exc) and "'big'" in str(exc),
                    f"unclear error: {exc}")
        c.check(ck.steps() == [], f"steps {ck.steps()}")


def async_worker(ctx: RankCtx) -> dict[str, list[str]]:
    mesh, _ = _meshes(ctx.world)
    root = Path(ctx.args["root"])
    out = {}
    for name, fn in (("mutation", _mutation), ("retention", _retention),
                     ("layout_change", _layout_change), ("store_keys", _store_keys),
                     ("early_manifest", _early_manifest), ("tree_edges", _tree_edge_cases),
                     ("per_rank_rng", _per_rank_rng),
                     ("fsdp_optimizer", _fsdp_optimizer_passed_directly),
                     ("wrapper_locals", _wrapper_locals),
                     ("replicated_dtensor", _differing_replicated_dtensor),
                     ("milestones", _milestones_and_model_alone)):
        if name == "fsdp_optimizer" and not fsdp2_on_cpu():
            continue  # (its test is skipped)
        c = Checks()
        c.run(name, fn, ctx, mesh, root, c)
        out[name] = c.failures
        ctx.barrier()
    return out


@pytest.fixture(scope="module")
def async_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    base = tmp_path_factory.mktemp("dist_async")
    runs = run_ranks(MODULE, "async_worker", 2, base / "run", args={"root": str(base / "ck")})
    merged: dict[str, list[str]] = {}
    for rank, run in sorted(runs.items()):
        for k, v in run.result.items():
            merged.setdefault(k, []).extend(f"rank {rank}: {x}" for x in v)
    return merged


def test_async_save_keeps_pre_mutation_values(async_results: dict[str, list[str]]) -> None:
    assert async_results["mutation"] == [], "\n".join(async_results["mutation"])


def test_keep_last_with_two_ranks_and_plan_reuse(async_results: dict[str, list[str]]) -> None:
    assert async_results["retention"] == [], "\n".join(async_results["retention"])


def test_layout_change_between_saves(async_results: dict[str, list[str]]) -> None:
    assert async_results["layout_change"] == [], "\n".join(async_results["layout_change"])


def test_manifest_merged_before_the_shards_are_durable(
        async_results: dict[str, list[str]]) -> None:
    assert async_results["early_manifest"] == [], "\n".join(async_results["early_manifest"])


def test_tied_empty_shards_disagreeing_trees_and_foreign_meshes(
        async_results: dict[str, list[str]]) -> None:
    assert async_results["tree_edges"] == [], "\n".join(async_results["tree_edges"])


def test_each_rank_gets_its_own_generators_back(async_results: dict[str, list[str]]) -> None:
    assert async_results["per_rank_rng"] == []


@pytest.mark.skipif(not fsdp2_on_cpu(), reason=f"torch {torch.__version__}: no FSDP2 on CPU")
def test_a_fresh_fsdp2_optimizer_passed_directly_is_refused_clearly(
        async_results: dict[str, list[str]]) -> None:
    assert async_results["fsdp_optimizer"] == []


def test_a_dtensor_whose_local_shard_is_a_wrapper_subclass_is_refused(
        async_results: dict[str, list[str]]) -> None:
    assert async_results["wrapper_locals"] == [], "\n".join(async_results["wrapper_locals"])


def test_a_replicated_dtensor_whose_ranks_differ_is_warned_about(
        async_results: dict[str, list[str]]) -> None:
    assert async_results["replicated_dtensor"] == [], "\n".join(
        async_results["replicated_dtensor"])


def test_milestones_and_the_model_alone_with_two_ranks(
        async_results: dict[str, list[str]]) -> None:
    assert async_results["milestones"] == [], "\n".join(async_results["milestones"])


def test_store_keys_do_not_grow_with_every_save(async_results: dict[str, list[str]]) -> None:
    notes = async_results["store_keys"]
    counts = [x for x in notes if "keys: " in x]
    assert len(counts) == 1 and len(notes) == 1, notes
    before, after = map(int, counts[0].split("keys: ")[1].split())
    assert after - before < 10, f"{after - before} new Store keys over 20 saves, 10 failed"


def test_bits_helper_is_strict() -> None:
    import torch

    a = torch.tensor([0.0, 1.0])
    assert same_bits(a, a.clone())
    assert not same_bits(a, torch.tensor([-0.0, 1.0]))
    assert not same_bits(a, a.double())
    assert bits(torch.zeros(0)) == b""


def test_harness_reports_child_tracebacks(tmp_path: Path) -> None:
    runs = run_ranks("_harness", "selftest_worker", 2, tmp_path / "ok", init_group=False)
    assert {r: run.result for r, run in runs.items()} == {
        0: {"rank": 0, "world": 2}, 1: {"rank": 1, "world": 2}}
    with pytest.raises(AssertionError) as err:
        run_ranks("_harness", "selftest_worker", 2, tmp_path / "raise", init_group=False,
                  args={"raise_on": 1})
    msg = str(err.value)
    assert "rank 1 (exit status 1" in msg and "rank 0 (" not in msg, msg
    assert "Traceback" in msg and "ValueError: boom from rank 1" in msg, msg


def test_harness_kills_hung_ranks_at_the_hard_timeout(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="hard timeout of 2s"):
        run_ranks("_harness", "selftest_worker", 2, tmp_path, init_group=False,
                  args={"hang": True}, timeout_s=2)
    assert time.monotonic() - t0 < 10
