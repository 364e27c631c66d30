"""Run under torchrun with 4 processes: stable ranks and leading rows of DTensor-sharded
weights equal the unsharded computation (cold and warm-started, fp32 and bf16), on a 1-D
mesh (rows, columns, experts, replicated, strided) and on a 2-D FSDP-over-TP mesh built by
`parallelize_module` + `fully_shard` (strided shards of uneven size included); and only
vectors and scalars (never a weight matrix) cross ranks: no weight is regathered. Exits
non-zero with a message on any mismatch."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

import gamma_titan  # noqa: F401
from gamma_titan.diagnostics import StableRanks, leading_rows

RTOL = 1e-5
#: Power-iteration steps (cold, warm): both sides take the same, so they agree at any count;
#: few keep the gloo collectives (two per step) quick.
ITERS = (40, 10)


class CollectiveSizes(TorchDispatchMode):
    """The element count of every tensor handed to a collective: functional ones (DTensor
    redistributions) seen by dispatch, and dist.all_reduce calls, patched."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __enter__(self):
        self._all_reduce = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            self.sizes.append(tensor.numel())
            return self._all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
        return super().__enter__()

    def __exit__(self, *exc):
        dist.all_reduce = self._all_reduce
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in str(func) and "wait" not in str(func) and args and isinstance(args[0], torch.Tensor):
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def check(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not torch.allclose(got, expected, rtol=RTOL, atol=0):
        sys.exit(f"{what}: stable rank {got} != unsharded {expected}")


def one_dimensional(mesh) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = {
        "matrix": torch.randn(96, 64, generator=gen) @ torch.diag(torch.linspace(0.5, 2, 64)),
        "experts": torch.randn(4, 48, 32, generator=gen),
        "bf16": (torch.randn(80, 40, generator=gen) @ torch.diag(torch.linspace(0.5, 2, 40))).bfloat16(),
    }
    placements = (Shard(0), Shard(1), Replicate(), _StridedShard(0, split_factor=2))
    for name, w in weights.items():
        # (a strided shard needs its dimension divisible by split factor x ranks)
        strided = _StridedShard(1 if name == "experts" else 0, split_factor=2)
        for placement in (*placements[:3], strided):
            key = f"{name}-{placement}"
            reference, sharded = StableRanks(*ITERS), StableRanks(*ITERS, stack=True)
            for call in ("cold", "warm"):
                expected = reference(key, w if call == "cold" else w * 1.01 + 0.01)
                shard = distribute_tensor(w if call == "cold" else w * 1.01 + 0.01, mesh, [placement])
                with CollectiveSizes() as sizes:
                    got = sharded(key, shard)
                check(got, expected, f"{key} ({call})")
                if not sizes.sizes:
                    sys.exit(f"{key}: no collective seen; the size check below would be vacuous")
                if max(sizes.sizes) * 4 > w.numel():
                    sys.exit(f"{key}: a collective moved {max(sizes.sizes)} elements of a {w.numel()}-element weight")
            if sharded.iterations[key] != reference.iterations[key]:
                sys.exit(f"{key}: {sharded.iterations[key]} steps, unsharded {reference.iterations[key]}")
    w = weights["matrix"]
    for placement in placements:
        with CollectiveSizes() as sizes:
            rows = leading_rows(distribute_tensor(w, mesh, [placement]), 8)
        if not torch.equal(rows, w[:8]):
            sys.exit(f"leading_rows under {placement}: wrong rows")
        if max(sizes.sizes) > 8 * w.shape[1]:
            sys.exit(f"leading_rows under {placement}: moved {max(sizes.sizes)} elements for 8 rows")


def fsdp_over_tp() -> None:
    """TorchTitan's layout: TP's column-wise weights sharded again by FSDP on the same
    dimension (strided shards), row-wise ones on the other; 10 rows over 2x2 is uneven."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.ModuleDict({"wq": nn.Linear(48, 96, bias=False), "wk": nn.Linear(48, 96, bias=False),
                           "wo": nn.Linear(96, 48, bias=False), "odd": nn.Linear(48, 10, bias=False)})
    full = {n: m.weight.detach().clone() for n, m in model.items()}  # the same on every rank
    parallelize_module(model, mesh["tp"], {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                           "wo": RowwiseParallel(), "odd": ColwiseParallel()})
    for module in model.values():
        fully_shard(module, mesh=mesh["dp"])
    sharded = {n: m.weight for n, m in model.items()}
    if not isinstance(sharded["wq"].placements[0], _StridedShard):
        sys.exit(f"FSDP over TP: expected a strided shard, got {sharded['wq'].placements}")
    reference, ranks = StableRanks(*ITERS), StableRanks(*ITERS, stack=True)  # stacked, as on a GPU
    vectors = sum(w.shape[0] + w.shape[1] + 1 for w in full.values())  # every u, v and ‖W‖_F²
    for call in ("cold", "warm"):
        expected = reference.all(full)
        with CollectiveSizes() as sizes:
            got = ranks.all(sharded)
        for name in full:
            check(got[name], expected[name], f"FSDP over TP, {name} ({call})")
        if max(sizes.sizes) > vectors:
            sys.exit(f"FSDP over TP: a collective moved {max(sizes.sizes)} elements, more than the "
                     f"{vectors} of all the vectors")
    for name, w in sharded.items():
        if not torch.equal(leading_rows(w, 8), full[name][:8]):
            sys.exit(f"leading_rows of {name} under {w.placements}: wrong rows")


def main() -> None:
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        sys.exit("run with 4 processes")
    one_dimensional(init_device_mesh("cpu", (4,)))
    fsdp_over_tp()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
