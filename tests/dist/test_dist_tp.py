"""FSDP2 + tensor parallel: DTensors with ``_StridedShard`` placements saved and loaded.

Four ranks on a 2x2 ("dp", "tp") mesh train a small model (ColwiseParallel +
RowwiseParallel, then fully_shard) for one AdamW step and save its model and optimizer
state. The Colwise layer's weight and bias come out of ``get_state_dict`` as
``(_StridedShard(0, sf=2), Shard(0))``, here unevenly (10 rows on 2x2: 3, 2, 3, 2).
The checkpoint is loaded back into the same layout, whole in one process, and into a
plain FSDP2 model on two ranks; every value must come back bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import Checks, RankCtx, bits, full_tensor, run_ranks
from _torch_compat import dtensor_api, fully_shard_fn

import asyncckpt

MODULE = "test_dist_tp"

# What this torch has: FSDP2 over tensor parallel makes _StridedShard placements from
# torch 2.5 on; DTensorSpec takes a shard order in recent versions only.
HAS_STRIDED = hasattr(dtensor_api("placement_types"), "_StridedShard")
HAS_ORDER = hasattr(dtensor_api("_dtensor_spec"), "ShardOrderEntry")
pytestmark = pytest.mark.skipif(not HAS_STRIDED, reason=f"torch {torch.__version__} has no "
                                "_StridedShard placements to save")
IN, HIDDEN, OUT = 4, 10, 5  # HIDDEN rows of the Colwise weight split unevenly on 2x2
STEP = 1


def _leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, tensor) of every tensor of a nested dict/list state, in a fixed order."""
    import torch

    if isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from _leaves(tree[k], f"{path}/{k}" if path else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}/{i}" if path else str(i))
    elif isinstance(tree, torch.Tensor):
        yield path, tree


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "device_mesh") else t


def _full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "device_mesh") else t


def _model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, OUT))


def _fsdp_tp(seed: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    fully_shard = fully_shard_fn()
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _model(seed)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)


def _fsdp(seed: int, world: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    fully_shard = fully_shard_fn()

    model = _model(seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)


def _train_step(model: Any, opt: Any) -> None:
    import torch

    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(7))  # the same on all ranks
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _target(model: Any, opt: Any) -> dict[str, Any]:
    """A fresh model's state to load into, optimizer state tensors included."""
    import torch

    state = _state(model, opt)
    if not state["optim"]["state"]:  # give the fresh optimizer its state, params unchanged
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for g in opt.param_groups:
            g["lr"] = 0.0
        opt.step()
        for g in opt.param_groups:
            g["lr"] = 0.1
        opt.zero_grad(set_to_none=True)
        state = _state(model, opt)
    return state


def _load_and_apply(ck: Any, model: Any, opt: Any) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    target = _target(model, opt)
    ck.load(target, step=STEP)
    set_state_dict(model, opt, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])


def _empty_model(seed: int) -> Any:
    """A model with parameters some ranks hold nothing of: a (4, 0) adapter, and a Linear
    whose single input column tensor parallel leaves one rank of each pair without."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, 1), torch.nn.ReLU(), torch.nn.Linear(1, 3))
    model.register_parameter("adapter", torch.nn.Parameter(torch.randn(4, 0)))
    return model


def _empty_shards(ctx: RankCtx, root: Path, c: Checks) -> dict[str, Any]:
    """FSDP2 + TP where FSDP2 gives a shard with no elements the local shape (0, 0) rather
    than the (2, 0) its placements say: saved and loaded back bit-exact (both refused)."""
    from torch.distributed.device_mesh import init_device_mesh
    fully_shard = fully_shard_fn()
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build(seed: int) -> Any:
        model = _empty_model(seed)
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model

    model = build(seed=0)
    state = model.state_dict()
    locals_ = {k: list(_local(t).shape) for k, t in state.items()}
    before = {k: _local(t).clone() for k, t in state.items()}
    with asyncckpt.AsyncCheckpointer(root, timeout_s=30) as ck:
        c.run("save", ck.save, {"model": state}, STEP)
        fresh = build(seed=1)
        c.run("load", ck.load, {"model": fresh}, step=STEP)
    for k, t in fresh.state_dict().items():
        c.check(bits(_local(t)) == bits(before[k]) and _local(t).shape == before[k].shape,
                f"{k} reloaded: {_local(t)} != {before[k]}")
    return {"locals": locals_,
            "placements": {k: str(t.placements) for k, t in state.items()}}


def _ordered(ctx: RankCtx, root: Path, c: Checks) -> None:
    """A DTensor whose shard order is not the mesh's: Shard(0) twice on 2x2, split by mesh
    dim 1 first (rank (i, j) holds row block 2j + i of 4, not 2i + j). Saved as its
    placements alone say, its rows came back scrambled."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    dt = dtensor_api()
    DTensor, Shard, distribute_tensor = dt.DTensor, dt.Shard, dt.distribute_tensor
    dt = dtensor_api("_dtensor_spec")
    DTensorSpec, ShardOrderEntry, TensorMeta = dt.DTensorSpec, dt.ShardOrderEntry, dt.TensorMeta

    mesh = init_device_mesh("cpu", (2, 2))
    full = full_tensor("order/o", ORDERED)
    i, j = mesh.get_coordinate()
    mine = full.chunk(2, 0)[j].chunk(2, 0)[i].clone()

    def ordered(local: Any) -> Any:
        spec = DTensorSpec(mesh, (Shard(0), Shard(0)),
                           TensorMeta(full.shape, full.stride(), full.dtype),
                           shard_order=(ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),))
        return DTensor(local, spec, requires_grad=False)

    dt = ordered(mine)
    c.check(bits(dt.full_tensor()) == bits(full), "torch disagrees on the test's layout")
    with asyncckpt.AsyncCheckpointer(root, timeout_s=30) as ck:
        c.run("save", ck.save, {"o": dt}, STEP)
        back = ordered(torch.zeros_like(mine))
        c.run("load ordered", ck.load, {"o": back}, step=STEP)
        c.check(bits(back.to_local()) == bits(mine), f"ordered reload: {back.to_local()}")
        default = distribute_tensor(torch.zeros_like(full), mesh, [Shard(0), Shard(0)],
                                    src_data_rank=None)
        c.run("load default order", ck.load, {"o": default}, step=STEP)
        want = distribute_tensor(full, mesh, [Shard(0), Shard(0)], src_data_rank=None)
        c.check(bits(default.to_local()) == bits(want.to_local()),
                f"default-order reload: {default.to_local()}")


ORDERED = (7, 3)  # 7 rows split by mesh dim 1 (4, 3), then by mesh dim 0 (2, 2 | 2, 1)


# --- rank workers ------------------------------------------------------------------------------

def tp_worker(ctx: RankCtx) -> dict[str, Any]:
    """Train, save, and load back into a fresh FSDP2 + TP model; report the full values."""
    c = Checks()
    root = Path(ctx.args["root"])
    model, opt = _fsdp_tp(seed=0)
    _train_step(model, opt)
    state = _state(model, opt)
    placements = {p: str(t.placements) for p, t in _leaves(state) if hasattr(t, "placements")}
    before = {p: _local(t).clone() for p, t in _leaves(state)}
    full = {p: [str(_full(t).dtype), list(t.shape), bits(_full(t)).hex()]
            for p, t in _leaves(state)}
    with asyncckpt.AsyncCheckpointer(root, timeout_s=30) as ck:
        ck.save(state, STEP)
        # (a) the same layout, fresh weights and optimizer: every local shard bit-exact
        model2, opt2 = _fsdp_tp(seed=1)
        c.run("load tp", _load_and_apply, ck, model2, opt2)
    after = dict(_leaves(_state(model2, opt2)))
    c.check(sorted(after) == sorted(before), f"keys {sorted(after)} != {sorted(before)}")
    for p, want in before.items():
        got = _local(after[p]) if p in after else None
        c.check(got is not None and bits(got) == bits(want) and got.shape == want.shape,
                f"tp reload {p}: {got} != {want}")
    empty, order = Checks(), Checks()
    seen = empty.run("empty shards", _empty_shards, ctx, root.parent / "empty", empty)
    ctx.barrier()
    if HAS_ORDER:
        order.run("shard order", _ordered, ctx, root.parent / "ordered", order)
    return {"failures": c.failures, "placements": placements, "full": full,
            "empty": empty.failures, "empty_layout": seen, "order": order.failures}


def fsdp_worker(ctx: RankCtx) -> dict[str, Any]:
    """Load the 4-rank FSDP2 + TP checkpoint into a plain FSDP2 model (1-D mesh)."""
    c = Checks()
    model, opt = _fsdp(seed=2, world=ctx.world)
    with asyncckpt.AsyncCheckpointer(Path(ctx.args["root"]), timeout_s=30) as ck:
        c.run("load fsdp", _load_and_apply, ck, model, opt)
    got = {p: _full(t) for p, t in _leaves(_state(model, opt))}
    want = ctx.args["full"]
    c.check(sorted(got) == sorted(want), f"keys {sorted(got)} != {sorted(want)}")
    for p, (dtype, shape, hexbits) in want.items():
        t = got.get(p)
        c.check(t is not None and str(t.dtype) == dtype and list(t.shape) == shape
                and bits(t).hex() == hexbits, f"fsdp reload {p}: {t}")
    return {"failures": c.failures}


# --- the tests ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("tp")
    runs = run_ranks(MODULE, "tp_worker", 4, base / "run_tp", args={"root": str(base / "ck")},
                     timeout_s=90)
    return {"root": base / "ck", "base": base,
            "results": {r: run.result for r, run in runs.items()}}


def test_fsdp_tp_strided_shards_save_and_reload_bit_exact(tp_run: dict[str, Any]) -> None:
    results = tp_run["results"]
    for r in range(4):
        assert results[r]["failures"] == [], (r, results[r]["failures"])
    pls = results[0]["placements"]
    assert pls["model/0.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", pls
    assert pls["optim/state/0.weight/exp_avg"] == pls["model/0.weight"], pls
    assert all(results[r]["full"] == results[0]["full"] for r in range(4))
    m = asyncckpt.AsyncCheckpointer(tp_run["root"]).manifest(STEP)
    assert m.world_size == 4
    # 10 rows on 2x2 with FSDP over TP: (offset, rows) 0/3, 3/2, 5/3, 8/2
    rows = sorted((c.offsets[0], c.lengths[0]) for c in m.tensors["model/0.weight"].chunks)
    assert rows == [(0, 3), (3, 2), (5, 3), (8, 2)], rows


def test_fsdp_zero_element_shards_save_and_reload_bit_exact(tp_run: dict[str, Any]) -> None:
    results = tp_run["results"]
    for r in range(4):
        assert results[r]["empty"] == [], (r, results[r]["empty"])
    # what FSDP2 makes of them (what the test is about): no elements, shape (0, 0)
    seen = results[1]["empty_layout"]
    assert seen["placements"]["2.weight"] == "(Shard(dim=0), Shard(dim=1))", seen
    assert seen["locals"]["2.weight"] == [0, 0] and seen["locals"]["adapter"] == [0, 0], seen
    got = asyncckpt.load(tp_run["base"] / "empty")["model"]
    want = _empty_model(seed=0).state_dict()
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert (t.dtype, t.shape, bits(t)) == (got[k].dtype, got[k].shape, bits(got[k])), k


@pytest.mark.skipif(not HAS_ORDER, reason=f"torch {torch.__version__} has no shard orders")
def test_a_dtensor_in_another_shard_order_saves_its_own_rows(tp_run: dict[str, Any]) -> None:
    results = tp_run["results"]
    for r in range(4):
        assert results[r]["order"] == [], (r, results[r]["order"])
    m = asyncckpt.AsyncCheckpointer(tp_run["base"] / "ordered").manifest(STEP)
    rows = sorted((c.offsets[0], c.lengths[0]) for c in m.tensors["o"].chunks)
    assert rows == [(0, 2), (2, 2), (4, 2), (6, 1)], rows
    got = asyncckpt.load(tp_run["base"] / "ordered")["o"]
    assert bits(got) == bits(full_tensor("order/o", ORDERED)) and got.shape == ORDERED


def test_fsdp_tp_checkpoint_loads_whole_in_one_process(tp_run: dict[str, Any]) -> None:
    import torch

    full = tp_run["results"][0]["full"]
    got = dict(_leaves(asyncckpt.load(tp_run["root"])))
    assert sorted(got) == sorted(full)
    for p, (dtype, shape, hexbits) in full.items():
        t = got[p]
        assert isinstance(t, torch.Tensor) and not hasattr(t, "device_mesh"), p
        assert (str(t.dtype), list(t.shape), bits(t).hex()) == (dtype, shape, hexbits), p


def test_fsdp_tp_checkpoint_loads_into_plain_fsdp_on_two_ranks(tp_run: dict[str, Any]) -> None:
    runs = run_ranks(MODULE, "fsdp_worker", 2, tp_run["base"] / "run_fsdp",
                     args={"root": str(tp_run["root"]), "full": tp_run["results"][0]["full"]},
                     timeout_s=90)
    for r, run in runs.items():
        assert run.result["failures"] == [], (r, run.result["failures"])


def test_strided_shard_that_is_not_one_box_is_refused(tmp_path: Path) -> None:
    runs = run_ranks(MODULE, "refuse_worker", 2, tmp_path / "run", timeout_s=60,
                     args={"root": str(tmp_path / "ck")})
    for r, run in runs.items():
        assert run.result["failures"] == [], (r, run.result["failures"])


def refuse_worker(ctx: RankCtx) -> dict[str, Any]:
    """A lone _StridedShard gives each rank scattered rows: refused with a clear error."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    distribute_tensor = dtensor_api().distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from asyncckpt.errors import UnsupportedLeafError

    c = Checks()
    mesh = init_device_mesh("cpu", (ctx.world,))
    t = distribute_tensor(torch.arange(8.0).reshape(8, 1), mesh,
                          [_StridedShard(0, split_factor=2)], src_data_rank=None)
    c.check(t.to_local().reshape(-1).tolist() == ([0, 1, 4, 5] if ctx.rank == 0
                                                  else [2, 3, 6, 7]), str(t.to_local()))
    try:
        with asyncckpt.AsyncCheckpointer(Path(ctx.args["root"]), timeout_s=30) as ck:
            ck.save({"w": t}, 1)
        c.check(False, "saved a strided shard that is not one box")
    except UnsupportedLeafError as exc:
        c.check("not one contiguous range" in str(exc) and "'w'" in str(exc), str(exc))
    return {"failures": c.failures}
