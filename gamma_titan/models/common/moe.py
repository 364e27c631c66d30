"""Fine-grained mixture of experts: TorchTitan's MoE layer with our router.

TorchTitan's `MoE` (grouped-GEMM experts, shared experts, the expert-parallel and
load-balancing hooks that its parallel plans and optimizer expect) and its token reorderer
are reused as they are. The router is ours: it routes in fp32, keeps the load counter
moe_load_metrics reads, and hands the layer the scores for the auxiliary loss; it counts
tokens per expert with `tokens_per_expert`.

TorchTitan counts tokens per expert with `torch.histc` on the int64 expert indices, which
the CPU does not implement ("histogram_cpu not implemented for 'Long'"). The one answer,
for gamma_moe and for TorchTitan's own MoE models (models/titan/moe.py):
`IntegerHistcByScatter`, scoped to TorchTitan's call off CUDA, counts the same integers
with `tokens_per_expert`; on CUDA TorchTitan's code runs unchanged.

Routing is token-choice top-k over sigmoid (or softmax) scores. Load balancing is
DeepSeek-V3's pair:
  * auxiliary-loss-free: a per-expert bias, added to the scores only to choose experts, is
    nudged after each optimizer step towards an even load (TorchTitan's
    `build_optimizers_with_moe_load_balancing`; `load_balance_coeff` is its step size, which
    must keep up with how fast the router's scores move, i.e. with the learning rate);
  * the complementary sequence-wise auxiliary loss α·E·Σ_i f_i·P_i, per sequence and then
    averaged (f_i: the share of the sequence's routed slots that go to expert i, P_i: its
    mean normalised score; 1·α when perfectly balanced). It enters through the gradient
    only (`AuxLossGrad`), so the logged training loss stays the language-model loss; its
    value is logged as `moe/aux_loss`: the mean over the MoE layers and the global batches
    since the last log, whatever the data-parallel degree and accumulation steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torchtitan.models.moe import moe as titan_moe
from torchtitan.models.moe import utils as moe_utils
from torchtitan.models.moe.kernels import generate_permute_indices
from torchtitan.models.moe.moe import GroupedExperts, MoE, MoEArgs, TokenReorderer, _run_experts_for_loop
from torchtitan.tools.utils import _round_up


def tokens_per_expert(expert_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many routed (token, slot) pairs each expert gets (int64: the experts split
    their input by these counts)."""
    flat = expert_indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class IntegerHistcByScatter(TorchFunctionMode):
    """`torch.histc(indices, bins=E, min=0, max=E)` of integer indices, as TorchTitan calls
    it (bins of width 1), counted by `tokens_per_expert`: the same counts, int64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.histc and not args[0].is_floating_point():
            bins = kwargs["bins"] if "bins" in kwargs else args[1]
            return tokens_per_expert(args[0], bins)
        return func(*args, **kwargs)


class CountingReorderer(TokenReorderer):
    """TorchTitan's TokenReorderer, with IntegerHistcByScatter off CUDA."""

    def forward(self, top_scores: torch.Tensor, selected_experts_indices: torch.Tensor):
        if selected_experts_indices.device.type == "cuda":
            return super().forward(top_scores, selected_experts_indices)
        with IntegerHistcByScatter():
            return super().forward(top_scores, selected_experts_indices)


def balance_loss(scores: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """E·Σ_i f_i·P_i over a set of tokens: scores (tokens, E), counts (E,) of their routed slots."""
    num_experts = scores.shape[-1]
    share = counts.float() / (scores.shape[0] * top_k)  # f_i, sums to 1
    mean_score = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)  # P_i, sums to 1
    return num_experts * (share * mean_score).sum()


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, sequence_group=None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: `balance_loss` of each sequence, averaged.
    scores (batch, seq, E), indices (batch, seq, k) of the chosen experts.

    Under context parallelism a rank holds part of each sequence: `sequence_group` (the CP
    ranks) sums the sequences' counts and scores over its ranks first, so every rank has the
    whole sequences' loss; its gradient reaches this rank's own scores only (the others'
    sums enter as constants), and the data-parallel gradient sum adds up the rest."""
    batch, seq, num_experts = scores.shape
    top_k = indices.shape[-1]
    counts = torch.zeros(batch, num_experts, dtype=torch.float32, device=scores.device)
    counts.scatter_add_(1, indices.reshape(batch, -1), torch.ones(batch, seq * top_k, device=scores.device))
    score_sums = (scores / scores.sum(dim=-1, keepdim=True)).sum(dim=1)
    if sequence_group is not None:
        import torch.distributed._functional_collectives as funcol

        counts = funcol.all_reduce(counts, "sum", sequence_group)
        whole = funcol.all_reduce(score_sums.detach(), "sum", sequence_group)
        score_sums = score_sums + (whole - score_sums.detach())
        seq = seq * torch.distributed.get_world_size(sequence_group)
    share = counts / (seq * top_k)  # f per sequence
    mean_score = score_sums / seq  # P per sequence
    return num_experts * (share * mean_score).sum(dim=-1).mean()


class AuxLossGrad(torch.autograd.Function):
    """Forward: `x` unchanged. Backward: also send gradient 1 into `aux` (a scalar that
    hangs off the router), i.e. train on loss + aux without adding it to the output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class CountsLoad:
    """Mixed into a router: `load`, the routed (token, slot) pairs per expert since the last
    metrics log (moe_load_metrics reads and resets it). TorchTitan's tokens_per_expert is
    reset by the load-balancing step, so it cannot serve."""

    def init_load(self, num_experts: int) -> None:
        self.register_buffer("load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def reset_buffers(self, device) -> None:
        self.load = torch.zeros(self.load.shape[0], dtype=torch.int64, device=device)


class TokenChoiceRouter(CountsLoad, nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str,
                 route_norm: bool, route_scale: float, aux_loss_coeff: float = 0.0):
        super().__init__()
        self.aux_loss_coeff = aux_loss_coeff
        self.routed: tuple[torch.Tensor, torch.Tensor] | None = None  # (scores, indices) for the aux loss
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        # debug.moe_force_load_balance (set by parallelize_moe): experts taken round-robin,
        # token t's slot j going to expert (t·k + j) mod E, for benchmarks of a balanced load.
        self.force_load_balance = False
        self.init_load(num_experts)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        """x: (tokens, dim) -> scores of the chosen experts (tokens, k), their indices
        (tokens, k), and the number of tokens per expert (num_experts,)."""
        logits = self.gate(x).float()  # routing in fp32
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else F.softmax(logits, dim=-1)
        choice = scores if expert_bias is None else scores + expert_bias
        if self.force_load_balance:
            slots = torch.arange(x.shape[0] * self.top_k, device=x.device, dtype=torch.int64)
            indices = (slots % self.num_experts).view(x.shape[0], self.top_k)
        else:
            _, indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)
        top = scores.gather(1, indices)  # the bias picks experts; it does not weight them
        if self.route_norm:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        counts = tokens_per_expert(indices, self.num_experts)
        with torch.no_grad():
            self.load += counts
        if self.aux_loss_coeff > 0 and torch.is_grad_enabled():
            self.routed = (scores, indices)  # the layer makes the sequence-wise loss of them
        return top * self.route_scale, indices, counts


@torch.no_grad()
def moe_load_metrics(model_parts: list[nn.Module], batch_group=None, pp_group=None) -> dict[str, float]:
    """Expert load since the last call, per MoE layer, summed over data-parallel ranks
    (and context-parallel ones, which hold other chunks of the sequences: a collective on
    `batch_group`, every rank must call it), then reset. Under pipeline
    parallelism each stage measures its own layers and `pp_group` gathers them, so that
    every stage logs every layer (and the aux loss over all of them).

    `moe/load_max_over_mean/layer_{i}` is the busiest expert's share over the average
    share (1 = perfectly even), `moe/load_min_over_mean/layer_{i}` the idlest's (0 = an
    unused expert); `moe/load_max_over_mean` is the worst layer. Token-choice routing has
    no capacity limit, so no token is ever dropped.
    """
    routers = [(name, m) for part in model_parts for name, m in part.named_modules() if isinstance(m, CountsLoad)]
    per_layer: dict[str, tuple[float, float]] = {}  # layer -> (max, min) over mean
    aux_pair = [0.0, 0.0]  # Σ aux·share, Σ share over this stage's layers and the batch's ranks
    if routers:
        loads = torch.stack([m.load for _, m in routers]).float()
        if batch_group is not None:
            torch.distributed.all_reduce(loads, group=batch_group)
        for _, router in routers:
            router.load.zero_()
        mean = loads.mean(dim=1).clamp_min(1e-9)
        layers = [m for part in model_parts for m in part.modules()
                  if isinstance(m, MoELayer) and m.aux_loss_sum is not None]
        numbers = [loads.max(dim=1).values / mean, loads.min(dim=1).values / mean]
        if layers:  # the global batch's mean aux loss since the last call: Σ aux·share / Σ share, over ranks
            aux = torch.stack([torch.stack([m.aux_loss_sum, m.aux_loss_sum.new_tensor(m.aux_loss_share)])
                               for m in layers]).sum(dim=0)
            if batch_group is not None:
                torch.distributed.all_reduce(aux, group=batch_group)
            for m in layers:
                m.aux_loss_sum, m.aux_loss_share = None, 0.0
            numbers.append(aux)
        host = torch.cat(numbers).tolist()  # every number in one device-to-host transfer
        n = len(routers)
        per_layer = {name.split("layers.")[1].split(".")[0]: (host[i], host[n + i]) for i, (name, _) in enumerate(routers)}
        if layers:
            aux_pair = host[2 * n:]
    if pp_group is not None:  # every stage's layers (a stage may hold none)
        stages = [None] * torch.distributed.get_world_size(pp_group)
        torch.distributed.all_gather_object(stages, (per_layer, aux_pair), group=pp_group)
        per_layer = {layer: v for stage_layers, _ in stages for layer, v in stage_layers.items()}
        aux_pair = [sum(pair[i] for _, pair in stages) for i in (0, 1)]
    if not per_layer:
        return {}
    metrics = {}
    for layer, (most, least) in sorted(per_layer.items(), key=lambda kv: int(kv[0])):
        metrics[f"moe/load_max_over_mean/layer_{layer}"] = most
        metrics[f"moe/load_min_over_mean/layer_{layer}"] = least
    metrics["moe/load_max_over_mean"] = max(most for most, _ in per_layer.values())
    if aux_pair[1] > 0:
        metrics["moe/aux_loss"] = aux_pair[0] / aux_pair[1]
    return metrics


def permute_by_local_expert(x: torch.Tensor, counts: torch.Tensor, ep_degree: int, n_local: int):
    """Reorder tokens into one padded group per local expert, as grouped GEMMs want them
    (TorchTitan's generate_permute_indices: its Triton kernel for CUDA tensors, its CPU
    implementation otherwise; no host sync either way).

    `counts` is (ep_degree * n_local,): tokens for local expert j from rank r at r*n_local+j
    (ep_degree 1: the tokens are already sorted by expert). Returns (shape of x plus one
    zero row, permuted x, the permutation, padded group sizes).
    """
    align = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    max_len = _round_up(x.shape[0] + n_local * align, align)
    with torch.no_grad():
        if is_fake(counts):
            # A memory estimate (FakeTensorMode: gamma_titan/estimate.py) has no counts to read;
            # the permutation's shapes do not depend on them.
            indices = torch.zeros(max_len, dtype=torch.int32, device=x.device)
            group_sizes = torch.full((n_local,), max_len // n_local, dtype=torch.int32, device=x.device)
        else:
            indices, group_sizes, _ = generate_permute_indices(
                counts, n_local, ep_degree, max_len, align, use_cpu=x.device.type == "cpu"
            )
    x = torch.vstack((x, x.new_zeros((x.shape[-1],))))  # row -1: what padding slots read
    return x.shape, x[indices, :], indices, group_sizes


def unpermute(out: torch.Tensor, shape: torch.Size, indices: torch.Tensor) -> torch.Tensor:
    """The inverse of permute_by_local_expert (padding rows land on the dropped last row)."""
    restored = out.new_empty(shape)
    restored[indices, :] = out
    return restored[:-1]


#: The routed experts' kernel ([model_args] expert_kernel): "auto" = grouped GEMMs for CUDA
#: tensors and the exact fp32 loop for any other; "grouped" or "loop" on every device.
EXPERT_KERNELS = ("auto", "grouped", "loop")


class RoutedExperts(GroupedExperts):
    """TorchTitan's expert stack, with the kernel chosen per call (`kernel`, EXPERT_KERNELS):
    grouped GEMMs (bf16, tokens permuted into padded per-expert groups) or the exact fp32
    loop over experts. "auto" decides from the input's device: a flag fixed when the model
    is built would send CPU tensors down the CUDA path on a GPU host (inspect, the startup
    summary, report tokens, the converters all run the model on the CPU there). "grouped"
    on a CPU runs torch's CPU grouped-GEMM fallback: how the tests take the CUDA path."""

    FAN_IN_DIM = -1  # stored (experts, out, in): each expert contracts the last dimension

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, kernel: str = "auto"):
        super().__init__(dim, hidden_dim, num_experts, use_grouped_mm=kernel != "loop")
        self.kernel = kernel

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        grouped = self.kernel == "grouped" or self.kernel == "auto" and x.device.type == "cuda"
        if not grouped and not is_fake(x):  # the loop reads the counts; an estimate runs the GPU's kernel
            # Each expert's weights as views of one unbind: indexing the stacked tensor per
            # expert instead makes every expert's backward write a zero gradient as large as
            # the whole stack (64 experts of 768 x 256: ~95% of a qwen3 debugmodel_moe step).
            return _run_experts_for_loop(w1.unbind(0), w2.unbind(0), w3.unbind(0), x, num_tokens_per_expert)
        # TorchTitan's kernel looked up at each call, as its GroupedExperts does: its
        # apply_compile replaces the module's function with the compiled one (marked dynamic
        # in the token count under expert parallelism); a reference bound at import would
        # keep running the eager SiLU·mul
        grouped_mm = titan_moe._run_experts_grouped_mm
        if isinstance(self.w1, DTensor) and "ep" in self.w1.device_mesh.mesh_dim_names:
            # ExpertParallel's dispatch has permuted and padded the tokens already
            return grouped_mm(w1, w2, w3, x, num_tokens_per_expert)
        shape, x, order, sizes = permute_by_local_expert(x, num_tokens_per_expert, 1, self.num_experts)
        return unpermute(grouped_mm(w1, w2, w3, x, sizes), shape, order)


class MoELayer(MoE):
    #: γ groups (models/common/decoder.py, declared_init_rule): routed and shared experts
    #: are feed-forward weights; the router has its own group.
    GAMMA_GROUPS = {"": "ffn", "router.": "router"}

    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int, aux_loss_coeff: float = 0.0,
                 expert_kernel: str = "auto"):
        super().__init__(moe_args, dim=dim, hidden_dim=hidden_dim)
        self.experts = RoutedExperts(dim, hidden_dim, moe_args.num_experts, expert_kernel)
        self.router = TokenChoiceRouter(
            dim, moe_args.num_experts, moe_args.top_k, moe_args.score_func,
            moe_args.route_norm, moe_args.route_scale, aux_loss_coeff,
        )
        self.reorderer = CountingReorderer(moe_args.num_experts, moe_args.top_k)
        # The LM loss is a sum over tokens / the global token count (TorchTitan), so a
        # per-micro-batch mean aux loss is weighted by this micro-batch's share of the
        # global batch (set_micro_batch_share). Under pipeline parallelism the trainer divides
        # the gradients by the global token count after the backward (TorchTitan's schedule
        # back-propagates loss sums): the aux gradient is multiplied by it first
        # (set_aux_grad_scale), a buffer so that a compiled block does not specialise on it.
        self.aux_loss_weight = 1.0
        self.register_buffer("aux_grad_scale", torch.ones(()), persistent=False)
        self.sequence_group = None  # the context-parallel ranks that share each sequence (sequence_balance_loss)
        # For the log (RoutingLedger, moe_load_metrics): Σ aux·share and Σ share since the last log.
        self.last_aux_loss: torch.Tensor | None = None
        self.aux_loss_sum: torch.Tensor | None = None
        self.aux_loss_share = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, dim)."""
        out = super().forward(x)
        if self.router.aux_loss_coeff == 0:
            return out
        routed, self.router.routed = self.router.routed, None
        if routed is not None:  # None under no_grad (evaluation)
            batch, seq, _ = x.shape
            scores, indices = routed
            aux = self.router.aux_loss_coeff * sequence_balance_loss(
                scores.view(batch, seq, -1), indices.view(batch, seq, -1), self.sequence_group)
            # Kept, not summed, here: activation checkpointing runs this forward again in the
            # backward, and an op that only the rerun makes breaks selective AC's replay
            # (RoutingLedger sums it once per training micro-batch).
            self.last_aux_loss = aux.detach()
            out = AuxLossGrad.apply(out, aux * self.aux_loss_weight * self.aux_grad_scale)
        return out

    def reset_buffers(self, device) -> None:
        """Zero load counters and expert bias (see DecoderLM.init_weights)."""
        with torch.device(device):
            self.aux_grad_scale = torch.ones(())
            self.tokens_per_expert = torch.zeros(self.experts.num_experts, dtype=torch.float32)
            if self.load_balance_coeff is not None:
                self.expert_bias = torch.zeros(self.experts.num_experts, dtype=torch.float32)


def routing_counters(model: nn.Module) -> list[torch.Tensor]:
    """The buffers a forward adds its routing counts to: our routers' `load` (the log) and
    TorchTitan's `tokens_per_expert` (the expert bias's next step)."""
    out = []
    for module in model.modules():
        if isinstance(module, CountsLoad):
            out.append(module.load)
        if isinstance(module, MoE) and isinstance(getattr(module, "tokens_per_expert", None), torch.Tensor):
            out.append(module.tokens_per_expert)
    return out


class RoutingLedger:
    """What each forward of a model part adds to the MoE's routing counters and to the
    auxiliary loss the next log reports, kept per forward until the trainer settles the
    micro-batch, so that forwards which are not training micro-batches are taken back.

    torch's pipeline schedules run a stage's forward once more than its micro-batches when
    they infer the tensors passed between stages (at the first step, and after each switch
    between training and evaluation), on all but the first stage on uninitialised memory:
    left in, that forward's routing would move the expert bias and the logged load and aux
    loss (measured on 2 stages: parameters 3-9% of the update away from one process's after
    4 steps). The extra forwards run first, so the last `micro_batches` forwards are kept.
    Activation checkpointing reruns blocks inside the backward, never the whole part, so
    it adds no forward here (TorchTitan's own counters double-count those reruns, which its
    sign-based bias step absorbs)."""

    def __init__(self, part: nn.Module) -> None:
        self.part = part  # its counters are looked up each time: reset_buffers replaces them
        self.layers = [m for m in part.modules() if isinstance(m, MoELayer)]
        self.before: list[list[torch.Tensor]] = []  # the counters before each forward
        self.aux: list[list[tuple[MoELayer, torch.Tensor]]] = []  # each forward's weighted aux losses
        if routing_counters(part) or self.layers:
            part.register_forward_pre_hook(self._before_forward)
            part.register_forward_hook(self._after_forward)

    @torch.no_grad()
    def _before_forward(self, module, args) -> None:
        self.before.append([c.clone() for c in routing_counters(self.part)])

    @torch.no_grad()
    def _after_forward(self, module, args, output) -> None:
        forward = []
        for layer in self.layers:
            if layer.last_aux_loss is not None:  # None under no_grad: evaluation, the probe
                forward.append((layer, layer.last_aux_loss * layer.aux_loss_weight))
                layer.last_aux_loss = None
        self.aux.append(forward)

    def start(self) -> None:
        """Before a training micro-batch: forget forwards since the last (evaluation)."""
        self.before.clear()
        self.aux.clear()

    @torch.no_grad()
    def settle(self, micro_batches: int) -> None:
        """After a training micro-batch that ran `micro_batches` forwards of this part:
        take back any earlier ones, record the aux losses of these."""
        extra = max(0, len(self.aux) - micro_batches)
        if extra:
            for counter, first, real in zip(routing_counters(self.part), self.before[0], self.before[extra]):
                counter.sub_(real - first)  # counts are whole numbers: exact
        for forward in self.aux[extra:]:
            for layer, weighted in forward:
                layer.aux_loss_sum = weighted if layer.aux_loss_sum is None else layer.aux_loss_sum + weighted
                layer.aux_loss_share += layer.aux_loss_weight
        self.start()


def set_sequence_group(model: nn.Module, group) -> None:
    """Tell every MoE layer which ranks hold the other chunks of its sequences (context
    parallelism): its sequence-wise balance loss sums their counts and scores."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.sequence_group = group


def set_micro_batch_share(model: nn.Module, share: float) -> None:
    """Tell every MoE layer which share of the global batch one forward is:
    1 / (data-parallel degree x gradient-accumulation steps x pipeline micro-batches)."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.aux_loss_weight = share


@torch.no_grad()
def set_aux_grad_scale(model: nn.Module, scale: float | torch.Tensor) -> None:
    """Under pipeline parallelism: the global token count the trainer will divide this
    step's gradients by (see MoELayer.aux_grad_scale)."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.aux_grad_scale.fill_(scale)
