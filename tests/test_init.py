"""γ-init: every weight's std is d_in^(−γ), norms start at 1, overrides and truncation
work, and `inspect`'s block-by-block init is the trainer's init. The values follow the
documented chunked scheme, so they do not depend on the device, the shard or the threads."""

import hashlib
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from helpers import small_args
from gamma_titan.init import draw, draw_range, fill_, ParamInit, param_seed
from gamma_titan.inspect_model import inspect_model
from gamma_titan.models.dense import GammaDense
from gamma_titan.models import TRAIN_SPECS

# Every matrix has >= 4096 entries, so a 5% band is > 4 standard errors of the std.
SHAPE = dict(dim=512, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden_dim=1024, vocab_size=1024)


def build(args, seed=0):
    args.init.seed = seed
    with torch.device("meta"):
        model = GammaDense(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return model


def expected_fan_in(name: str, shape) -> int:
    # Written out per weight, independently of the model's rule.
    if name.endswith("feed_forward.w2.weight"):
        return SHAPE["ffn_hidden_dim"]
    if name.endswith("attention.wo.weight"):
        return SHAPE["dim"]  # n_heads * head_dim
    return SHAPE["dim"]  # embedding rows, q/k/v/gate/w1/w3/output all read the width


@pytest.mark.parametrize("gamma", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_measured_std_matches_fan_in_rule(gamma, gate):
    model = build(small_args(gamma, gate, **SHAPE))
    seen = set()
    for name, p in model.named_parameters():
        if p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        target = expected_fan_in(name, p.shape) ** -gamma
        std = p.float().std().item()
        assert abs(std / target - 1) < 0.05, (name, std, target)
        assert abs(p.float().mean().item()) < 0.1 * target, name
        seen.add(name.split(".")[-2])
    assert {"tok_embeddings", "wq", "wk", "wv", "wo", "gate_proj", "w1", "w2", "w3", "output"} <= seen


def test_gate_shapes():
    head = build(small_args(gate="headwise", **SHAPE))
    elem = build(small_args(gate="elementwise", **SHAPE))
    none = build(small_args(gate="none", **SHAPE))
    assert head.layers["0"].attention.gate_proj.weight.shape == (8, 512)
    assert elem.layers["0"].attention.gate_proj.weight.shape == (8 * 64, 512)
    assert not hasattr(none.layers["0"].attention, "gate_proj")
    gated_keys = {k for k in elem.state_dict() if "gate_proj" not in k}
    assert set(none.state_dict()) == gated_keys


def test_per_group_override():
    args = small_args(1.0, **SHAPE)
    args.init.rate_overrides = {"output": 0.5, "embedding": 0.75}
    model = build(args)
    d = SHAPE["dim"]
    assert abs(model.output.weight.std().item() / d**-0.5 - 1) < 0.05
    assert abs(model.tok_embeddings.weight.std().item() / d**-0.75 - 1) < 0.05
    assert abs(model.layers["0"].attention.wq.weight.std().item() / d**-1.0 - 1) < 0.05


def test_truncation_cuts_tails():
    entry = ParamInit("w", "ffn", 256, 1.0)
    plain = draw(entry, (512, 256), seed=0)
    cut = draw(entry, (512, 256), seed=0, truncation=2.0)
    sigma = 256**-1.0
    assert plain.abs().max() > 3 * sigma
    assert cut.abs().max() <= 2 * sigma * (1 + 1e-7)  # float32 rounding of ≤ 2σ
    # std of N(0, 1) truncated at ±2 is 0.8796
    assert abs(cut.std().item() / (0.8796 * sigma) - 1) < 0.02


def test_seed_is_per_parameter_and_stable():
    assert param_seed(0, "a", 0) == param_seed(0, "a", 0)
    assert len({param_seed(0, "a", 0), param_seed(0, "b", 0), param_seed(1, "a", 0), param_seed(0, "a", 1)}) == 4
    a = build(small_args(**SHAPE), seed=3)
    b = build(small_args(**SHAPE), seed=3)
    c = build(small_args(**SHAPE), seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.output.weight, c.output.weight)


def test_inspect_block_by_block_init_equals_trainer_init():
    args = small_args(1.0, "headwise", **SHAPE)
    report = inspect_model(TRAIN_SPECS["gamma_dense"], args, seq_len=64, seed=7)
    model = build(small_args(1.0, "headwise", **SHAPE), seed=7)
    params = dict(model.named_parameters())
    assert [r["name"] for r in report["params"]] == list(params)
    for row in report["params"]:
        p = params[row["name"]].float()
        if row["target_std"] is not None:
            assert row["std"] == p.std().item(), row["name"]
            assert row["fan_in"] == expected_fan_in(row["name"], p.shape)
            assert math.isclose(row["target_std"], row["fan_in"] ** -1.0)


# --- The chunked scheme ------------------------------------------------------------------

CHUNK = 2**20  # elements per chunk, as documented in gamma_titan/init.py


def reference(name: str, numel: int, std: float, seed: int, truncation: float = 0.0) -> torch.Tensor:
    """The documented scheme, written out: chunk k of the flattened tensor is float32
    N(0, 1) from numpy's PCG64 seeded by blake2b("seed:name:k") (8 bytes, little-endian,
    63 bits); values beyond ± truncation are redrawn from it, in order, until none is;
    then times std in float32."""
    chunks = []
    for k, lo in enumerate(range(0, numel, CHUNK)):
        digest = hashlib.blake2b(f"{seed}:{name}:{k}".encode(), digest_size=8).digest()
        rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little") & (2**63 - 1)))
        z = rng.standard_normal(min(CHUNK, numel - lo), dtype=np.float32)
        bad = np.flatnonzero(np.abs(z) > truncation) if truncation else []
        while len(bad):
            z[bad] = rng.standard_normal(len(bad), dtype=np.float32)
            bad = bad[np.abs(z[bad]) > truncation]
        chunks.append(torch.from_numpy(z) * std)
    return torch.cat(chunks)


def test_values_follow_the_documented_scheme():
    model = build(small_args(1.0, **SHAPE), seed=3)
    for name in ("output.weight", "layers.1.feed_forward.w2.weight", "tok_embeddings.weight"):
        p = dict(model.named_parameters())[name]
        std = expected_fan_in(name, p.shape) ** -1.0
        assert torch.equal(p, reference(name, p.numel(), std, 3).view(p.shape)), name
    # a tensor of three chunks, the last one short; plain and truncated
    entry = ParamInit("layers.0.attention.wq.weight", "attention", 512, 1.0)
    for truncation in (0.0, 2.0):
        full = draw(entry, (5, 500_000), seed=3, truncation=truncation)
        assert torch.equal(full.view(-1), reference(entry.name, 2_500_000, 512**-1.0, 3, truncation))
    # Pinned numbers (σ = 1), so that a change in numpy's sampler shows: first values of
    # chunk 0, and the values around the boundary of chunks 0 and 1.
    entry = ParamInit("layers.0.attention.wq.weight", "attention", 1, 1.0)
    pinned = torch.tensor([-0.30224600434303284, 0.288441926240921, -0.4546947479248047])
    assert torch.equal(draw_range(entry, 2 * CHUNK, 0, 0, 3), pinned)
    pinned = torch.tensor([-0.17323456704616547, -1.1691641807556152, -0.41784724593162537, -0.1852315217256546])
    assert torch.equal(draw_range(entry, 2 * CHUNK, 0, CHUNK - 2, CHUNK + 2), pinned)


@pytest.mark.parametrize("truncation", [0.0, 2.0])
def test_any_range_equals_the_slice_of_the_full_draw(truncation):
    entry = ParamInit("w", "ffn", 300, 1.0)
    numel = 2 * CHUNK + 12345  # three chunks, the last one short
    full = draw(entry, (numel,), seed=1, truncation=truncation)
    ranges = [(0, numel), (0, 1), (5, 17), (100, CHUNK - 1), (CHUNK - 3, CHUNK + 4), (CHUNK, 2 * CHUNK),
              (CHUNK + 100, CHUNK + 200), (1, 2 * CHUNK + 1), (2 * CHUNK + 5, numel), (numel - 1, numel), (7, 7)]
    for start, stop in ranges:
        part = draw_range(entry, numel, 1, start, stop, truncation)
        assert torch.equal(part, full[start:stop]), (start, stop)
    small = draw(entry, (10, 100), seed=1, truncation=truncation).view(-1)  # under one chunk
    for start, stop in [(0, 1000), (0, 1), (10, 20), (999, 1000), (333, 667)]:
        assert torch.equal(draw_range(entry, 1000, 1, start, stop, truncation), small[start:stop])


def test_values_do_not_depend_on_cpu_threads():
    entry = ParamInit("w", "ffn", 300, 1.0)
    threads = torch.get_num_threads()
    drawn = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            drawn.append([draw(entry, (3 * CHUNK + 7,), seed=2), draw(entry, (3 * CHUNK + 7,), seed=2, truncation=1.5),
                          *build(small_args(**SHAPE), seed=2).parameters()])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*drawn))


#: Layouts on 8 ranks: (mesh shape, placements).
LAYOUTS = [
    ((8,), (Shard(0),)),  # FSDP=8
    ((2, 4), (Replicate(), Shard(0))),  # HSDP
    ((8,), (Shard(1),)),  # TP column blocks
    ((2, 4), (Shard(0), Shard(1))),  # FSDP × TP row-wise
    ((2, 4), (_StridedShard(0, split_factor=4), Shard(0))),  # FSDP over TP col-wise
    ((1, 8), (_StridedShard(0, split_factor=8), Shard(0))),  # EP 8 with FSDP 1 inside it: strided, size 1
    ((2, 2, 2), (Replicate(), _StridedShard(0, split_factor=2), Shard(0))),  # HSDP x EP x FSDP
]


@pytest.mark.skipif(dist.is_initialized(), reason="needs its own (fake) process group")
@pytest.mark.parametrize("truncation", [0.0, 2.0])
def test_every_rank_shard_is_the_cut_of_the_full_draw(truncation):
    """Each of 8 ranks (a fake process group, one rank at a time) fills its DTensor shard;
    it must equal the cut of the full draw, for shards inside and across chunks, and the
    rank must have drawn exactly the chunks that hold its shard's values (found by cutting
    the tensor of flat positions the same way)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shapes = {"b": (1003, 8), "c": (16, 12, 10)}  # uneven rows; 3-D
    if truncation == 0:  # several chunks each (truncation redraws inside a chunk only: the small ones show it)
        shapes |= {"a": (2100, 1024), "d": (8, 300, 1024)}  # 3 chunks; an expert stack of 2.3 chunks
    entries = {name: ParamInit(name, "ffn", 64, 1.0) for name in shapes}
    full = {name: draw(entries[name], shape, 5, truncation) for name, shape in shapes.items()}
    for rank in (0, 3, 6, 7):  # the ends and the middle of every mesh dimension
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            for mesh_shape, placements in LAYOUTS:
                mesh = init_device_mesh("cpu", mesh_shape)
                for name, shape in shapes.items():
                    param = distribute_tensor(torch.full(shape, float("nan")), mesh, placements, src_data_rank=None)
                    drawn = fill_(param, entries[name], 5, truncation)
                    cut = distribute_tensor(full[name], mesh, placements, src_data_rank=None)
                    assert torch.equal(param.to_local(), cut.to_local()), (rank, placements, name)
                    positions = distribute_tensor(torch.arange(full[name].numel()).view(shape), mesh, placements,
                                                  src_data_rank=None).to_local().flatten()
                    numel = full[name].numel()
                    chunks = (positions // CHUNK).unique().tolist()
                    assert drawn == sum(min(CHUNK, numel - k * CHUNK) for k in chunks), (rank, placements, name)
        finally:
            dist.destroy_process_group()
