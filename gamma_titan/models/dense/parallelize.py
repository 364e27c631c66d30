"""Tensor parallelism, activation checkpointing, torch.compile and FSDP2 for gamma_dense.

The order is TorchTitan's: TP → AC → compile (per block) → FSDP. Everything but the TP
plan is TorchTitan's own code (its llama3 helpers fit our module names); the TP plan
adds the attention gate, which is column-parallel like the queries: each rank computes
the gate of its own heads.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import NoParallel, ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.llama3.infra.parallelize import (
    _op_sac_save_list,
    apply_compile,
    apply_ddp,
    apply_fsdp,
)
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import device_type

from gamma_titan.config import FLOAT8_LINEAR
from gamma_titan.models.common.mla import GatedMLA


def parallelize_dense(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    if parallel_dims.tp_enabled:
        float8 = FLOAT8_LINEAR in job_config.model.converters
        rowwise_recipe = job_config.quantize.linear.float8.recipe_name in ("rowwise", "rowwise_with_gw_hp")
        apply_tp(
            model,
            parallel_dims.get_mesh("tp"),
            loss_parallel=not job_config.parallelism.disable_loss_parallel,
            float8_tensorwise=float8 and not rowwise_recipe,
        )
        maybe_enable_async_tp(job_config, parallel_dims.get_mesh("tp"))

    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=compile_model,
            op_sac_save_list=_op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
    if compile_model:
        apply_compile(model, job_config.compile)

    if parallel_dims.fsdp_enabled:
        mesh_names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(mesh_names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        if device_type == "cpu":
            force_sum_reductions(model)
        logger.info("Applied FSDP to the model")
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=compile_model)
    return model


def force_sum_reductions(model: nn.Module) -> None:
    """TorchTitan sets FSDP's gradient divide factor to 1 (it normalises the loss by the
    global token count itself), which FSDP implements as a PREMUL_SUM reduce-scatter;
    gloo has no PREMUL_SUM. With a factor of 1 a plain SUM is the same reduction."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool, float8_tensorwise: bool) -> None:
    """Megatron-style TP with sequence parallel norms, as TorchTitan's llama3 plan."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    if float8_tensorwise:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel as colwise,
            Float8RowwiseParallel as rowwise,
            PrepareFloat8ModuleInput as prepare_input,
        )
    else:
        colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput

    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            **attention_tp_plan(block.attention, colwise, rowwise, prepare_input),
            "ffn_norm": SequenceParallel(),
        }
        if isinstance(block.attention, GatedMLA):
            block.attention.tp_mesh = tp_mesh
        if hasattr(block, "feed_forward"):  # MoE layers are planned by parallelize_moe
            plan |= {
                "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": colwise(),
                "feed_forward.w2": rowwise(output_layouts=Shard(1)),
                "feed_forward.w3": colwise(),
            }
        parallelize_module(block, tp_mesh, plan)
    logger.info(f"Applied {'Float8 tensorwise ' if float8_tensorwise else ''}tensor parallelism")


def attention_tp_plan(attention: nn.Module, colwise, rowwise, prepare_input) -> dict:
    """Heads split across TP ranks: the projections into heads (and the gate) are
    column-parallel, the output projection row-parallel, and the attention runs on local
    tensors. In MLA the low-rank down-projections and their norms are replicated
    (NoParallel keeps their weights as replicated DTensors, so their gradients are
    complete on every rank); the up-projections into heads are column-parallel."""
    plan = {"attention.wo": rowwise(output_layouts=Shard(1))}
    if hasattr(attention, "gate_proj"):
        plan["attention.gate_proj"] = colwise()
    if not isinstance(attention, GatedMLA):
        return plan | {
            "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
        }
    plan |= {
        "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                   use_local_output=True),
        "attention.wkv_a": NoParallel(),
        "attention.kv_norm": NoParallel(),
        "attention.wkv_b": colwise(),
    }
    if hasattr(attention, "wq"):
        return plan | {"attention.wq": colwise()}
    return plan | {"attention.wq_a": NoParallel(), "attention.q_norm": NoParallel(), "attention.wq_b": colwise()}


def check_tp_shapes(args, tp: int) -> None:
    """Heads must split evenly across TP ranks (called in the pre-flight checks)."""
    from gamma_titan.errors import ConfigError

    if tp <= 1:
        return
    if args.n_heads % tp or args.kv_heads % tp:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree = {tp} must divide model_args.n_heads = "
            f"{args.n_heads} and the KV heads ({args.kv_heads})"
        )
    for key in ("ffn_hidden_dim", "moe_hidden_dim"):  # MLP widths split across TP ranks
        width = getattr(args, key, None)
        if width is not None and width % tp:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree = {tp} must divide model_args.{key} = {width}"
            )

