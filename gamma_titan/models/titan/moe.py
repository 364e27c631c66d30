"""TorchTitan's MoE layer, as TorchTitan's MoE families build it, made to run on a CPU and
to report its expert load.

TorchTitan's router and token reorderer count tokens per expert with `torch.histc` on
the int64 expert indices, which CPU does not implement, and its experts take the bf16
grouped-GEMM path wherever the flavor asks for it (qwen3's; deepseek_v3 turns it off below
SM90), a CPU included. Off CUDA these subclasses run TorchTitan's routing code as written
under models/common/moe.py's IntegerHistcByScatter (gamma_moe's answer too), and the
experts run the exact fp32 loop; on CUDA they are TorchTitan's code path unchanged. The
router also keeps the load counter moe_load_metrics reads (models/common/moe.py).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torchtitan.models.moe.moe import MoE, MoEArgs, TokenChoiceTopKRouter

from gamma_titan.init import canonical_name, unwrapped
from gamma_titan.models.common.moe import CountingReorderer, CountsLoad, IntegerHistcByScatter, RoutedExperts


class SumGradient(torch.autograd.Function):
    """The identity forward; backward, the gradient summed over a process group (a
    functional collective, which torch.compile traces)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None


class CountingRouter(CountsLoad, TokenChoiceTopKRouter):
    #: The TP group the scores' gradient is summed over, where it arrives split (complete_router_gradients).
    score_grad_group = None

    def __init__(self, moe_args: MoEArgs, dim: int):
        super().__init__(dim=dim, num_experts=moe_args.num_experts, num_expert_groups=moe_args.num_expert_groups,
                         num_limited_groups=moe_args.num_limited_groups, top_k=moe_args.top_k,
                         score_func=moe_args.score_func, route_norm=moe_args.route_norm,
                         route_scale=moe_args.route_scale, gate_bias=moe_args.gate_bias,
                         _debug_force_load_balance=moe_args._debug_force_load_balance)
        self.init_load(moe_args.num_experts)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        if x.device.type == "cuda":
            routed = super().forward(x, expert_bias)
        else:
            with IntegerHistcByScatter():
                routed = super().forward(x, expert_bias)
        with torch.no_grad():
            self.load += routed[2].to(self.load.dtype)
        if self.score_grad_group is not None:
            routed = (SumGradient.apply(routed[0], self.score_grad_group), *routed[1:])
        return routed


def make_cpu_capable(moe: MoE, moe_args: MoEArgs) -> None:
    """Swap a freshly built TorchTitan MoE's router, reorderer and experts for the classes
    above (the same parameters, so TorchTitan's init and names hold)."""
    _, hidden_dim, dim = moe.experts.w1.shape  # (experts, hidden, dim)
    moe.router = CountingRouter(moe_args, dim)
    moe.reorderer = CountingReorderer(num_experts=moe_args.num_experts, top_k=moe_args.top_k)
    moe.experts = RoutedExperts(dim, hidden_dim, moe_args.num_experts, "auto" if moe_args.use_grouped_mm else "loop")


def complete_router_gradients(model: nn.Module, parallel_dims) -> None:
    """TorchTitan 0.2.2 under TP (pytorch/torchtitan#2387, fixed upstream after 0.2.2):
    where the routed experts weight their outputs by the scores (score_before_experts off:
    deepseek_v3) the experts' output is each TP rank's part of a sum (their hidden dimension
    is split), and where EP borrows the TP ranks (expert TP 1) each rank routes its own
    tokens; either way the scores' gradient is a part, which TorchTitan's replicated router
    weight takes as the whole (measured on deepseek_v3's debug model at TP 2: the router's
    update 100% off one process's after one step). Summed over the TP ranks, it is whole.
    Call after TorchTitan's parallelize function: its apply_compile has swapped each MoE's
    router for a compiled wrapper, looked through here (unwrapped); a router of another
    kind is refused, not left uncorrected."""
    if not parallel_dims.tp_enabled:
        return
    borrowed = parallel_dims.ep_enabled and parallel_dims.etp == 1
    for name, module in model.named_modules():
        if not isinstance(module, MoE) or not (borrowed or not module.score_before_experts):
            continue
        router = unwrapped(module.router)
        if not isinstance(router, CountingRouter):
            raise TypeError(f"{canonical_name(name)}.router is a {type(router).__name__}, not the CountingRouter whose "
                            "score gradient is summed over tensor parallelism: its gradient would be one rank's part")
        router.score_grad_group = parallel_dims.get_mesh("tp").get_group()


def reset_load(model: nn.Module, device) -> None:
    """The load counters after `to_empty` (garbage) or a fresh start: zero."""
    for module in model.modules():
        if isinstance(module, CountsLoad):
            module.reset_buffers(device)
