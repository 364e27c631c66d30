"""Test machinery: TorchTitan's MoE families under tensor parallelism 2 with torch.compile
(and with full activation checkpointing as well), built and parallelized in torch's fake
process group (one process standing for rank 0 of 2; no collective runs): which router each
MoE layer holds after the family's parallelize function, and whether the gradient fix of
gamma_titan/models/titan/moe.py reached it. TorchTitan's apply_compile swaps each MoE's
router for a compiled wrapper; a fix that tested the router's type missed every one.

    python compiled_routers.py OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import gamma_titan  # noqa: F401  (CPU platform shims before torchtitan)
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.models.moe.moe import MoE  # noqa: E402

from gamma_titan.config import load_job_config  # noqa: E402
from gamma_titan.init import canonical_name, unwrapped  # noqa: E402
from gamma_titan.models.titan.moe import CountingRouter  # noqa: E402
from gamma_titan.training.derive import derive_settings  # noqa: E402
from gamma_titan.training.train_spec import resolve_model  # noqa: E402
from helpers import REPO  # noqa: E402

FAMILIES = {"deepseek_v3": ("configs/titan/deepseek_v3_debug.toml", "debugmodel"),
            "qwen3_moe": ("configs/titan/qwen3_debug.toml", "debugmodel_moe")}
WRAPPINGS = {"compile": ["--compile.enable", "true", "--compile.backend", "eager"],
             "ac+compile": ["--compile.enable", "true", "--compile.backend", "eager",
                            "--activation_checkpoint.mode", "full"]}
WORLD = 2


def case(config: str, flavor: str, wrapping: list[str]) -> list[dict]:
    job = load_job_config(["--job.config_file", str(REPO / config), "--model.flavor", flavor, *wrapping,
                           "--parallelism.tensor_parallel_degree", str(WORLD),
                           "--parallelism.data_parallel_shard_degree", "1"])
    spec, args = resolve_model(job)
    derive_settings(job, args, WORLD, WORLD)
    with torch.device("meta"):
        model = spec.model_cls(args)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=WORLD, pp=1, ep=1, etp=1, world_size=WORLD)
    dims.build_mesh()
    spec.parallelize_fn(model, dims, job)
    return [{"layer": canonical_name(name), "wrapper": type(module.router).__name__,
             "router": type(unwrapped(module.router)).__name__,
             "score_grad_group": isinstance(unwrapped(module.router), CountingRouter)
             and unwrapped(module.router).score_grad_group is not None}
            for name, module in model.named_modules() if isinstance(module, MoE)]


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    results = {f"{family}-{how}": case(*FAMILIES[family], flags)
               for family in FAMILIES for how, flags in WRAPPINGS.items()}
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
