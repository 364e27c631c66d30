"""[optimizer] weight_decay_policy: AdamW's parameter groups (gamma_titan/training/optimizer.py).

The groups are checked here on every registered family; the parallel layouts train with them
through the configs (gamma_dense / gamma_moe set "megatron": test_parallel.py's FSDP 2 and
TP 2, test_moe_training.py's EP 2 and its EP 2 x FSDP 2 resume, test_resume.py's bitwise
extension) and through the family matrix (tests/test_families.py: every family at FSDP 2,
TP 2, PP 2 and DDP 2 with "megatron")."""

import pytest
import torch
from torch import nn

from gamma_titan.config import load_job_config
from gamma_titan.training.optimizer import decay_counts
from gamma_titan.training.preflight import preflight
from helpers import REPO, family_debug_config



def family_configs() -> dict[str, tuple]:
    """Every registered family with its debug config (helpers.family_debug_config), every
    other debug config of a family (gamma_moe's MLA one), and qwen3's MoE flavor."""
    import tomllib

    from gamma_titan.models import TRAIN_SPECS

    out = {name: family_debug_config(name) for name in TRAIN_SPECS}
    for path in sorted((REPO / "configs").glob("*/*debug*.toml")):
        name = tomllib.loads(path.read_text())["model"]["name"]
        if out[name][0] != path:
            out[f"{name} ({path.stem})"] = (path, ())
    return out | {"qwen3 (MoE)": (REPO / "configs" / "titan" / "qwen3_debug.toml", ("--model.flavor", "debugmodel_moe"))}


CONFIGS = family_configs()


def norm_and_bias_names(model: nn.Module) -> set[str]:
    """The parameters Megatron-LM spares, found by module type: every RMSNorm's scale and
    every bias (independent of the policy's own rule, which reads shapes and names)."""
    names = set()
    for name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            if pname == "bias" or isinstance(module, (nn.RMSNorm, nn.LayerNorm)) or "RMSNorm" in type(module).__name__:
                names.add(f"{name}.{pname}" if name else pname)
    return names


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_groups_hold_exactly_the_expected_names(family, builtin_assets):
    from torchtitan.distributed import ParallelDims

    config_file, overrides = CONFIGS[family]
    argv = ["--job.config_file", str(config_file), *overrides, "--optimizer.weight_decay_policy", "megatron"]
    config = load_job_config(argv)
    spec, args = preflight(config, world_size=1)
    from gamma_titan.models import TRAIN_SPECS

    model = TRAIN_SPECS[config.model.name].model_cls(args)
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    container = spec.build_optimizers_fn([model], config.optimizer, dims, None)  # the registered one
    [optimizer] = container.optimizers
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, spared = ({names[id(p)] for p in g["params"]} for g in optimizer.param_groups)
    expected_spared = norm_and_bias_names(model)
    assert spared == expected_spared and decayed == set(names.values()) - expected_spared
    assert len(spared) >= args.n_layers + 1  # a norm a block and the final one, at least
    decay, spare = optimizer.param_groups
    assert decay["weight_decay"] == config.optimizer.weight_decay == 0.1 and spare["weight_decay"] == 0.0
    assert {k: v for k, v in decay.items() if k not in ("params", "weight_decay")} == \
        {k: v for k, v in spare.items() if k not in ("params", "weight_decay")}
    counts = decay_counts(model, "megatron")
    assert counts["not_decayed"] == sum(p.numel() for n, p in model.named_parameters() if n in expected_spared)
    default = load_job_config(["--job.config_file", str(config_file), *overrides]).optimizer.weight_decay_policy
    assert default == ("all" if config_file.parent.name == "titan" else "megatron")  # TorchTitan's stay TorchTitan's


@pytest.mark.parametrize("policy, expected", [("megatron", 1.0), ("all", 1.0 - 0.1 * 1.0)])
def test_a_norm_scale_without_gradient_stays_at_one_only_when_spared(policy, expected):
    """AdamW, lr 0.1, weight decay 1.0, a zero gradient: the decoupled decay alone moves a
    parameter, by lr x wd x value. An RMSNorm scale stays at 1 under "megatron" and shrinks
    to 0.9 under "all"; the matrix shrinks under both."""
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import Optimizer as OptimizerConfig
    from torchtitan.distributed import ParallelDims

    from gamma_titan.training.optimizer import with_weight_decay_policy

    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.RMSNorm(4))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    config = OptimizerConfig(name="AdamW", lr=0.1, weight_decay=1.0, implementation="for-loop")
    config.weight_decay_policy = policy
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    container = with_weight_decay_policy(build_optimizers)([model], config, dims, None)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    container.step()
    assert torch.equal(model[1].weight, torch.full((4,), expected))
    assert torch.allclose(model[0].weight, torch.full((4, 4), 0.9))
