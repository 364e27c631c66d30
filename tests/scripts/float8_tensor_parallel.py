"""Test machinery: every attention gate x family under tensorwise float8 (emulated) and
tensor parallelism 2: the family's parallelize builds its TP plan on the float8-converted
model, and one forward and backward runs through it.

The world is torch's fake process group (one process standing for rank 0 of 2; its
collectives move no data), because gloo cannot all-gather float8 tensors ("Invalid scalar
type"), which torchao's float8 input preparation does: the numbers are not compared, the
plan and the modules it meets are.

    python float8_tensor_parallel.py OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import gamma_titan  # noqa: F401  (CPU platform shims before torchtitan)
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.protocols.model_converter import build_model_converters  # noqa: E402

from gamma_titan.config import load_job_config  # noqa: E402
from gamma_titan.training.derive import derive_settings  # noqa: E402
from gamma_titan.training.train_spec import resolve_model  # noqa: E402
from helpers import REPO  # noqa: E402

CONFIGS = {"dense": "configs/dense/debug.toml", "moe_mha": "configs/moe/debug.toml",
           "moe_mla": "configs/moe/debug_mla.toml"}
GATES = ("none", "headwise", "elementwise")
WORLD = 2


def case(family: str, gate: str) -> dict:
    config = load_job_config(["--job.config_file", str(REPO / CONFIGS[family]), "--model.converters",
                              "quantize.linear.float8", "--quantize.linear.float8.emulate", "true",
                              "--gamma.attention_gate", gate, "--model_args.n_layers", "2",
                              "--parallelism.tensor_parallel_degree", str(WORLD),
                              "--parallelism.data_parallel_shard_degree", "1",
                              "--parallelism.expert_parallel_degree", "1"])
    spec, args = resolve_model(config)
    derive_settings(config, args, WORLD, WORLD)  # float8's filter_fqns, as pre-flight fills them
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=WORLD, pp=1, ep=1, etp=1, world_size=WORLD)
    dims.build_mesh()
    build_model_converters(config, dims).convert(model)
    spec.parallelize_fn(model, dims, config)
    tokens = torch.randint(0, args.vocab_size, (2, 65), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    attention = {name: type(m).__name__ for name, m in model.layers["0"].attention.named_children()
                 if isinstance(m, torch.nn.Linear)}
    column = {name: isinstance(m.weight, DTensor) and m.weight.placements == (Shard(0),)
              for name, m in model.layers["0"].attention.named_children() if isinstance(m, torch.nn.Linear)}
    return {"attention_linears": attention, "column_split": column,
            "gradients": sum(1 for p in model.parameters() if p.grad is not None),
            "parameters": sum(1 for _ in model.parameters())}


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    results = {f"{family}-{gate}": case(family, gate) for family in CONFIGS for gate in GATES}
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
