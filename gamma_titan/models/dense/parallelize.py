"""Tensor parallelism, activation checkpointing, torch.compile and FSDP2 for gamma_dense.

The order is TorchTitan's: TP → CP → AC → compile (per block) → FSDP. Everything but the TP
plan (models/common/parallelize.py, which adds the attention gate) is TorchTitan's own
code: its llama3 helpers fit our module names.
"""

from __future__ import annotations

from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.llama3.infra.parallelize import (
    _op_sac_save_list,
    apply_compile,
    apply_ddp,
    apply_fsdp,
)
from torchtitan.tools.logging import logger

from gamma_titan.models.common.parallelize import FLOAT8_LINEAR, apply_context_parallel, apply_tp


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
    if parallel_dims.cp_enabled:
        apply_context_parallel(model, parallel_dims.get_mesh("cp"))

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
        logger.info("Applied FSDP to the model")
    elif parallel_dims.dp_replicate_enabled:  # replicas only: no other parallelism (training/layout.py)
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=compile_model)
    return model
