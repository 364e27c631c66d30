"""Parallelism pieces every family shares: the tensor-parallel plan of the decoder
(embedding, norms, output, attention of any kind, a dense SwiGLU), FSDP on gloo, and
DDP's gradient reduction.

Heads are split across TP ranks Megatron-style, as TorchTitan's llama3 plan does; the
attention gate is column-parallel like the queries, so each rank gates its own heads.
"""

from __future__ import annotations

import torch
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
from torchtitan.distributed import NoParallel
from torchtitan.tools.logging import logger

from .mla import GatedMLA

#: TorchTitan's `model.converters` name of float8 linear layers (torchao).
FLOAT8_LINEAR = "quantize.linear.float8"


def force_sum_reductions(model: nn.Module) -> None:
    """TorchTitan sets FSDP's gradient divide factor to 1 (it normalises the loss by the
    global token count itself), which FSDP implements as a PREMUL_SUM reduce-scatter;
    gloo has no PREMUL_SUM. With a factor of 1 a plain SUM is the same reduction."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def sum_ddp_gradients(model: nn.Module, group) -> None:
    """DDP (TorchTitan's apply_ddp: composable replicate) averages gradients over replicas,
    but TorchTitan's loss is already divided by the global token count (as it sets FSDP's
    divide factor to 1): averaged, the gradient is divided by the replicas twice (measured:
    half the single-process gradient norm at 2 replicas, so clipping and the update differ).
    Summed, it is the single-process gradient, provided the replicas reduce once a step:
    GammaTrainer turns DDP's sync off for all but the last micro-batch (a reduction that sums
    would otherwise add the gradient reduced at the previous micro-batch in again). Call
    after apply_ddp, before the first step."""
    model.register_comm_hook(group, _all_reduce_sum)


def _all_reduce_sum(group, bucket):
    work = torch.distributed.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


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


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """TorchTitan's context parallelism: its CP plan on every block's SDPA module (ring
    attention over the CP ranks' chunks of the sequence; the rotary positions come with
    the batch, DecoderLM.forward), and the MoE layers' sequence-wise balance loss summed
    over the ranks that share a sequence."""
    from torchtitan.distributed.context_parallel import apply_cp_to_attention_module

    from .moe import set_sequence_group

    apply_cp_to_attention_module([block.attention.sdpa for block in model.layers.values()], cp_mesh, "sdpa")
    set_sequence_group(model, cp_mesh.get_group())
