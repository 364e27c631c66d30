"""Which parameters AdamW decays: `[optimizer] weight_decay_policy` (gamma-titan's addition to
TorchTitan's [optimizer]).

  all       TorchTitan 0.2.2's choice: every parameter (its container hands AdamW
            `model.parameters()` in one group).
  megatron  Megatron-LM's, the paper's trainer: no decay for biases and 1-D parameters (the
            RMSNorm scales), "do not regularize biases nor Norm parameters"
            (megatron/core/optimizer); every matrix (embedding, head, experts) is decayed.

The family's own optimizer builder (TorchTitan's, with its MoE load-balancing hook where the
family has one) makes the container; the policy then splits each optimizer's group in two
before any step, so the hooks, the LR schedulers and DCP's flattened optimizer state (kept
per parameter, groups included) see ordinary AdamW parameter groups. Shapes are global
shapes: a DTensor shard of a matrix is still 2-D.
"""

from __future__ import annotations

from torch import nn

from gamma_titan.init import canonical_name


def decays(name: str, param: nn.Parameter, policy: str) -> bool:
    """Whether `policy` decays this parameter (`name` as the model names it)."""
    if policy == "all":
        return True
    return not (canonical_name(name).endswith(".bias") or param.ndim == 1)


def split_weight_decay(container, policy: str) -> None:
    """Move every parameter `policy` does not decay into a group of its own with weight
    decay 0 (the other hyperparameters as they are), in each optimizer of `container`."""
    names = {id(p): n for part in container.model_parts for n, p in part.named_parameters()}
    for optimizer in container.optimizers:
        for group in list(optimizer.param_groups):
            kept = [p for p in group["params"] if not decays(names[id(p)], p, policy)]
            if not kept:
                continue
            decayed = [p for p in group["params"] if decays(names[id(p)], p, policy)]
            if not decayed:  # one parameter per optimizer (optimizer steps in backward)
                group["weight_decay"] = 0.0
                continue
            group["params"] = decayed
            optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"},
                                       "params": kept, "weight_decay": 0.0})


def with_weight_decay_policy(build_optimizers):
    """A family's build_optimizers_fn, followed by the [optimizer] weight_decay_policy."""

    def build(model_parts, optimizer_config, parallel_dims, ft_manager=None):
        container = build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
        if optimizer_config.weight_decay_policy != "all":
            split_weight_decay(container, optimizer_config.weight_decay_policy)
        return container

    return build


def decay_counts(model: nn.Module, policy: str) -> dict:
    """Values decayed and not under `policy` (startup summary, `inspect`)."""
    counts = {"policy": policy, "decayed": 0, "not_decayed": 0}
    for name, param in model.named_parameters():
        counts["decayed" if decays(name, param, policy) else "not_decayed"] += param.numel()
    return counts
