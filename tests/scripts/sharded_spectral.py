"""Run under torchrun with 2 processes: stable ranks and leading rows of DTensor-sharded
weights equal the unsharded computation, and only vectors and scalars (never a weight
matrix) cross ranks. Exits non-zero with a message on any mismatch."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

import gamma_titan  # noqa: F401
from gamma_titan.diagnostics import StableRanks, leading_rows


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


def main() -> None:
    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(0)
    weights = {
        "matrix": torch.randn(96, 64, generator=gen) @ torch.diag(torch.linspace(0.5, 2, 64)),
        "experts": torch.randn(4, 48, 32, generator=gen),
    }
    mesh = init_device_mesh("cpu", (2,))
    reference, sharded = StableRanks(), StableRanks()
    for name, w in weights.items():
        expected = reference(name, w)
        for placement in (Shard(0), Shard(1), Replicate()):
            key = f"{name}-{placement}"
            with CollectiveSizes() as sizes:
                got = sharded(key, distribute_tensor(w, mesh, [placement]))
            if not torch.allclose(got, expected, rtol=1e-5, atol=0):
                sys.exit(f"{key}: stable rank {got} != unsharded {expected}")
            if not sizes.sizes:
                sys.exit(f"{key}: no collective seen; the size check below would be vacuous")
            if max(sizes.sizes, default=0) * 4 > w.numel():
                sys.exit(f"{key}: a collective moved {max(sizes.sizes)} elements of a {w.numel()}-element weight")
    w = weights["matrix"]
    for placement in (Shard(0), Shard(1), Replicate(), _StridedShard(0, split_factor=2)):
        with CollectiveSizes() as sizes:
            rows = leading_rows(distribute_tensor(w, mesh, [placement]), 8)
        if not torch.equal(rows, w[:8]):
            sys.exit(f"leading_rows under {placement}: wrong rows")
        if not isinstance(placement, _StridedShard) and max(sizes.sizes) > 8 * w.shape[1]:
            sys.exit(f"leading_rows under {placement}: moved {max(sizes.sizes)} elements for 8 rows")
    # FSDP over TP on one dimension gives strided shards: regathered first, still exact
    strided = StableRanks()("strided", distribute_tensor(w, mesh, [_StridedShard(0, split_factor=2)]))
    if not torch.allclose(strided, reference.__call__("again", w), rtol=1e-5, atol=0):
        sys.exit(f"strided shard: stable rank {strided} != unsharded")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
