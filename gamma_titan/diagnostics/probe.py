"""What one forward of the probe batch shows about the activations (paper §2.1, §2.4).

`ActivationProbe` hooks a model for one forward and measures:

* sink score per layer: attention mass on the first token (sink.py), from the layer's
  own queries and keys, under the mask the layer was given (a flex flavor's block-causal
  mask: each document's first token), at the attention's own softmax scale;
* residual flow ‖h_L − e‖ / ‖e‖ over the whole probe batch: e is the embedding stream
  (the first block's input), h_L the last block's output, read at the blocks of
  `model.layers` whatever is inside them;
* ε-dominated fraction per norm site: the share of positions whose RMSNorm input has
  mean square σ²(h) below 10·ε, where ε stops being negligible and the norm no longer
  sees the scale of h; a layer's fraction is over every position of every norm in it,
  each application counted once (norms inside attention, such as QK-norms, run again when
  the probe asks the attention for its queries and keys: those runs are not counted);
* gate mean and sparsity (share of gate values below 0.1) per layer, with the gate on.

Under tensor parallelism each rank sees its own heads, so head statistics are sums and
counts, added over the TP group at the end; norm inputs are sequence-sharded DTensors
there and are read whole (they are activations of a few sequences, not weights). The
residual stream between blocks is each rank's local shard of the sequence there: its
sums are added over the TP group too (were it replicated, both sums would grow by the TP
degree alike, and the ratio would not move).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import BlockMask

from gamma_titan.init import canonical_name, unwrapped

from .sink import first_token_mass

#: RMSNorm is ε-dominated where ε > EPS_DOMINANCE · σ²(h): it no longer sees the scale
#: of h (the paper's §2.1).
EPS_DOMINANCE = 0.1


def eps_dominates(norm_eps: float, hidden_var: float) -> bool:
    """Whether ε dominates an RMSNorm whose input has variance σ²(h) (`inspect` at init,
    the recipe planner's runs)."""
    return norm_eps > EPS_DOMINANCE * hidden_var

#: A gate value below this counts as closed (gate sparsity).
GATE_CLOSED = 0.1

_LAYER_SITE = re.compile(r"layers\.(\d+)\.(.+)")
FINAL_NORM = "norm"


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ActivationProbe:
    """`with ActivationProbe(model) as probe: model(tokens)`, then `probe.metrics()`."""

    def __init__(self, model: nn.Module, tp_group: dist.ProcessGroup | None = None):
        self.model, self.tp_group = model, tp_group
        self.head_stats: dict[str, list[torch.Tensor]] = {}   # tag -> [sum, count] over local heads
        self.site_stats: dict[str, list[torch.Tensor]] = {}   # tag -> [sum, count], complete
        self._embedding: torch.Tensor | None = None
        self._handles: list = []
        self._asking_attention = False  # inside probe_qk / probe_gate: the forward's norms run again

    def __enter__(self) -> "ActivationProbe":
        # The modules themselves, never a wrapper of one (torch.compile's, activation
        # checkpointing's): a wrapper answers every attribute of the module it holds, so a
        # compiled attention was hooked twice, and the wrapper's hook saw its inputs before
        # the module's own tensor-parallel input hooks (a plain tensor beside DTensors).
        for name, module in self.model.named_modules():
            if unwrapped(module) is not module:
                continue
            name = canonical_name(name)
            if isinstance(module, nn.RMSNorm):
                self._handles.append(module.register_forward_pre_hook(self._norm_hook(name)))
            elif hasattr(module, "probe_qk"):  # an attention module (see probe_qk below)
                layer = _LAYER_SITE.match(name).group(1)
                self._handles.append(module.register_forward_hook(self._attention_hook(layer)))
        blocks = [unwrapped(block) for block in self.model.layers.children()]
        self._handles.append(blocks[0].register_forward_pre_hook(self._stream_in))
        self._handles.append(blocks[-1].register_forward_hook(self._stream_out))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --- hooks ---------------------------------------------------------------------

    @staticmethod
    def _add(stats: dict, tag: str, total: torch.Tensor, count: float) -> None:
        acc = stats.setdefault(tag, [torch.zeros((), device=total.device), torch.zeros((), device=total.device)])
        acc[0] += total.float()
        acc[1] += count

    def _norm_hook(self, site: str):
        def hook(module: nn.RMSNorm, inputs):
            if self._asking_attention:
                return
            h = _whole(inputs[0]).detach().float()
            eps = module.eps if module.eps is not None else torch.finfo(inputs[0].dtype).eps
            dominated = (eps > EPS_DOMINANCE * h.pow(2).mean(dim=-1)).sum()
            count = h.numel() // h.shape[-1]
            match = _LAYER_SITE.match(site)
            if match:
                layer, local = match.groups()
                self._add(self.site_stats, f"eps_dominated_fraction/layer_{layer}", dominated, count)
                self._add(self.site_stats, f"eps_dominated_fraction/layer_{layer}/{local}", dominated, count)
            else:
                self._add(self.site_stats, f"eps_dominated_fraction/{'final_norm' if site == FINAL_NORM else site}",
                          dominated, count)

        return hook

    def _stream_in(self, block, inputs) -> None:
        """e: the first block's input (the residual stream as the embedding leaves it)."""
        self._embedding = _local(inputs[0]).detach().float().clone()

    def _stream_out(self, block, inputs, output) -> None:
        """h_L: the last block's output; ‖h_L − e‖² and ‖e‖², summed over the TP group at the end."""
        if self._embedding is None:
            return
        h, e = _local(output).detach().float(), self._embedding
        self._add(self.head_stats, "residual_flow/diff", (h - e).pow(2).sum(), 0)
        self._add(self.head_stats, "residual_flow/base", e.pow(2).sum(), 0)

    def _attention_hook(self, layer: str):
        """An attention module says how to see inside it: `probe_qk(*inputs)` gives the
        rotated queries and keys (bs, seqlen, local heads, head_dim) its forward made of
        these inputs, `probe_scale` its softmax scale where it is not 1/√head_dim, and with a
        gate, `probe_gate(x)` the gate values. A flex attention's block mask comes among
        its inputs."""
        def hook(module, inputs, output):
            self._asking_attention = True
            try:
                q, k = module.probe_qk(*inputs)
                gate = module.probe_gate(inputs[0]).float() if module.gate != "none" else None
            finally:
                self._asking_attention = False
            mask = next((a for a in inputs if isinstance(a, BlockMask)), None)
            mass = first_token_mass(q.transpose(1, 2), k.transpose(1, 2), scale=getattr(module, "probe_scale", None),
                                    mask_mod=None if mask is None else mask.mask_mod)  # (batch, local heads)
            self._add(self.head_stats, f"sink_score/layer_{layer}", mass.sum(), mass.numel())
            if gate is not None:
                self._add(self.head_stats, f"gate_mean/layer_{layer}", gate.sum(), gate.numel())
                self._add(self.head_stats, f"gate_sparsity/layer_{layer}", (gate < GATE_CLOSED).sum(), gate.numel())

        return hook

    # --- results -------------------------------------------------------------------

    def metric_tensors(self) -> dict[str, torch.Tensor]:
        """Tag (without the `gamma/` prefix) -> a 0-d tensor on the model's device; nothing
        is read back to the host. A collective over the TP group."""
        out: dict[str, torch.Tensor] = {}
        if self.head_stats:
            sums = torch.stack([torch.stack(v) for v in self.head_stats.values()])
            if self.tp_group is not None:
                dist.all_reduce(sums, group=self.tp_group)
            totals = dict(zip(self.head_stats, sums))
            flow = [totals.pop(tag, None) for tag in ("residual_flow/diff", "residual_flow/base")]
            out.update({tag: s / c for tag, (s, c) in totals.items()})
            if flow[0] is not None:
                out["residual_flow_ratio"] = flow[0][0].sqrt() / flow[1][0].sqrt().clamp_min(1e-30)
        for tag, (s, c) in self.site_stats.items():
            out[tag] = s / c
        sinks = [v for k, v in out.items() if k.startswith("sink_score/layer_")]
        if sinks:
            out["sink_score/mean"] = torch.stack(sinks).mean()
        return out

    def metrics(self) -> dict[str, float]:
        """Tag (without the `gamma/` prefix) -> value: `metric_tensors`, read back at once."""
        return to_host(self.metric_tensors())


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-d tensors as floats, in one transfer (one host sync on a GPU)."""
    if not tensors:
        return {}
    values = torch.stack([t.detach().float().reshape(()) for t in tensors.values()]).tolist()
    return dict(zip(tensors, values))
