"""A family's contract, checked before launch: under tensor parallelism the plan the family's
parallelize applies places every parameter, nested ones too (gamma_titan/models/common/
parallelize.py `check_tensor_parallel_plan`, called by pre-flight through the family's args).

The mistakes a family's author makes with a shared attention that gains QK-norms, each on
the debug model with its first block's attention replaced (the meta device: nothing is
computed). Before, the first died at step 1 in `clip_grad_norm_` ("aten._foreach_norm got
mixed torch.Tensor and DTensor", naming no parameter) and the second after launch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from gamma_titan.config import load_job_config
from gamma_titan.errors import ConfigError
from gamma_titan.models.common.attention import GatedAttention
from gamma_titan.models.common.parallelize import (attention_tp_plan, check_tensor_parallel_plan, children_tp_plan,
                                                   shared_plan, TPStyles)
from gamma_titan.training.preflight import preflight
from gamma_titan.training.train_spec import resolve_model
from helpers import DEBUG_TOML

KEY = "parallelism.tensor_parallel_degree > 1"


class QKNormAttention(GatedAttention):
    """A shared attention with per-head QK-norms, and no plan of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.q_norm = nn.RMSNorm(self.head_dim)
        self.k_norm = nn.RMSNorm(self.head_dim)


class ForgetfulQKNormAttention(QKNormAttention):
    """Its own plan: the shared one, the norms left out."""

    def tensor_parallel_plan(self, styles):
        return attention_tp_plan(self, styles)


class PlannedQKNormAttention(QKNormAttention):
    """Its own plan, the norms included (replicated weights, each rank's heads)."""

    def tensor_parallel_plan(self, styles):
        return attention_tp_plan(self, styles) | {"q_norm": SequenceParallel(use_local_output=True),
                                                  "k_norm": SequenceParallel(use_local_output=True)}


class RenamedAttention(GatedAttention):
    """A subclass that adds no parameter: the shared plan is its plan."""


def debug_model(attention_cls=None) -> nn.Module:
    config = load_job_config(["--job.config_file", str(DEBUG_TOML)])
    spec, args = resolve_model(config)
    with torch.device("meta"):
        model = spec.model_cls(args)
        if attention_cls is not None:
            old = model.layers["0"].attention
            model.layers["0"].attention = attention_cls(args.dim, args.n_heads, args.kv_heads, args.head_dim, old.gate)
    return model


def refusal(attention_cls) -> str:
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel_plan(debug_model(attention_cls))
    return str(err.value)


def test_the_project_models_place_every_parameter():
    check_tensor_parallel_plan(debug_model())


def test_a_subclass_that_adds_norms_is_named_with_what_its_base_plan_does_not_know():
    assert refusal(QKNormAttention) == (
        f"{KEY}: layers.0.attention.q_norm.weight is placed by no style: QKNormAttention (layers.0.attention) takes "
        "GatedAttention's plan, which does not know 'q_norm'; give QKNormAttention a tensor_parallel_plan(styles) method")


def test_norms_left_out_of_a_modules_own_plan_are_named_by_path():
    assert refusal(ForgetfulQKNormAttention) == (
        f"{KEY}: layers.0.attention.q_norm.weight is placed by no style: ForgetfulQKNormAttention.tensor_parallel_plan "
        "(layers.0.attention) must plan 'q_norm'")


def test_a_complete_plan_and_a_subclass_without_parameters_pass():
    check_tensor_parallel_plan(debug_model(PlannedQKNormAttention))
    check_tensor_parallel_plan(debug_model(RenamedAttention))
    assert shared_plan(RenamedAttention(64, 2, 2, 32, "none")) is attention_tp_plan
    styles = TPStyles(*(object,) * 3, mesh=None)
    assert shared_plan(nn.Linear(2, 2)) is None and children_tp_plan(nn.Module(), styles) == {}


def test_a_module_with_no_plan_is_refused_by_pre_flight_in_one_line():
    """A block child with parameters and no plan: refused before any process group, by name."""
    from gamma_titan.training.preflight import check_parallelism

    config = load_job_config(["--job.config_file", str(DEBUG_TOML), "--parallelism.tensor_parallel_degree", "2",
                              "--parallelism.data_parallel_shard_degree", "1"])
    spec, args = resolve_model(config)

    class WithExtra(spec.model_cls):  # the debug model with an unplanned module in block 0
        def __init__(self, args):
            super().__init__(args)
            self.layers["0"].extra = nn.Linear(4, 4)

    check_parallelism(config, 2, args, cuda=False, model_cls=spec.model_cls)
    with pytest.raises(ConfigError) as err:
        check_parallelism(config, 2, args, cuda=False, model_cls=WithExtra)
    assert str(err.value) == (f"{KEY}: tensor parallelism has no plan for Linear ('extra' of TransformerBlock): give it a "
                              "tensor_parallel_plan(styles) method")
    preflight(config, world_size=2)  # the family's own model


@pytest.fixture
def reusing_family():
    """A family of its own args (no check of its own beyond the shapes) that reuses
    gamma_moe's model and parallelize_moe, registered under its own name."""
    import dataclasses

    from torchtitan.protocols import train_spec as registry

    from gamma_titan.models.moe.args import MoEModelArgs
    from gamma_titan.training.train_spec import register_families

    register_families()

    @dataclasses.dataclass
    class ReusingArgs(MoEModelArgs):
        def check_parallelism(self, layout) -> None:
            """Its author copied none of gamma_moe's layout refusals."""

    spec = registry.get_train_spec("gamma_moe")
    flavors = {name: ReusingArgs(**{f.name: getattr(a, f.name) for f in dataclasses.fields(a)})
               for name, a in spec.model_args.items()}
    registry.register_train_spec("reusing_moe", dataclasses.replace(spec, model_args=flavors))
    yield "reusing_moe"
    del registry._extra_train_specs["reusing_moe"]


def test_the_moe_contract_lives_with_parallelize_moe(reusing_family):
    """A family reusing parallelize_moe inherits what it cannot take, declared with it
    (MOE_CONTRACT): EP with TP is refused in one line before launch, and each attribute of
    a block that parallelize_moe, TorchTitan's EP/FSDP helpers and its load-balancing hook
    read is named when missing (MOE_BLOCK_CONTRACT). Before, EP x TP passed a family's args
    without gamma_moe's copy of the refusal and crashed after launch."""
    from gamma_titan.models.moe.parallelize import MOE_BLOCK_CONTRACT
    from gamma_titan.training.preflight import check_parallelism

    moe_toml = DEBUG_TOML.parent.parent / "moe" / "debug.toml"
    config = load_job_config(["--job.config_file", str(moe_toml), "--model.name", reusing_family,
                              "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"])
    spec, args = resolve_model(config)
    assert type(args).__name__ == "ReusingArgs"
    with pytest.raises(ConfigError) as err:
        check_parallelism(config, 4, args, cuda=False, model_cls=spec.model_cls)
    assert str(err.value) == (
        "parallelism.expert_parallel_degree = 2 with tensor_parallel_degree = 2: parallelize_moe does not combine "
        "expert and tensor parallelism yet; use --parallelism.data_parallel_shard_degree 4 "
        "--parallelism.tensor_parallel_degree 1 (shard 4 x ep 2)")

    config = load_job_config(["--job.config_file", str(moe_toml), "--model.name", reusing_family])
    spec, args = resolve_model(config)
    check_parallelism(config, 1, args, cuda=False, model_cls=spec.model_cls)  # gamma_moe's blocks keep the contract

    def without(*path: str):
        class Broken(spec.model_cls):
            def __init__(self, args):
                super().__init__(args)
                block = next(b for b in self.layers.values() if b.moe_enabled) if path[0] != "moe_enabled" \
                    else self.layers["0"]
                owner = block
                for part in path[:-1]:
                    owner = getattr(owner, part)
                delattr(owner, path[-1])

        return Broken

    with pytest.raises(ConfigError) as err:
        check_parallelism(config, 1, args, cuda=False, model_cls=without("moe", "load_balance_coeff"))
    assert str(err.value) == (
        "block layers.1 (MoEBlock) has moe_enabled but no moe.load_balance_coeff: parallelize_moe, "
        "TorchTitan's expert-parallel and FSDP helpers and its load-balancing hook read it "
        "(models/moe/parallelize.py MOE_BLOCK_CONTRACT)")
    with pytest.raises(ConfigError, match=r"^block layers.0 \(\w+\) has no moe_enabled: parallelize_moe reads it"):
        check_parallelism(config, 1, args, cuda=False, model_cls=without("moe_enabled"))
    assert "moe.experts.num_experts" in MOE_BLOCK_CONTRACT and "moe.expert_bias" in MOE_BLOCK_CONTRACT