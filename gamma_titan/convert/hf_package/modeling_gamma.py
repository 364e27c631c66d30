"""gamma-titan's decoders (dense and MoE, gated attention, MHA or MLA), for transformers
(trust_remote_code). A family with another block shape ships a file of its own next to
this one, with its block and a `GammaForCausalLM` subclass that names it (`block_class`).

Written by `gamma-titan convert to-hf`; needs only torch and transformers. The same model
as gamma_titan.models.dense / .moe (and TorchTitan's llama3, qwen3 and deepseek_v3 with
the paper's knobs), top to bottom:

    h = embed(tokens)
    h = h + Wo( gate(x) * attention(RoPE(Wq x), RoPE(Wk x), Wv x) ),  x = RMSNorm(h)
    h = h + FFN(x),                                                    x = RMSNorm(h)
    logits = Output(RMSNorm(h))

gate(x) = sigmoid(Wg x), one value per head ("headwise") or per channel ("elementwise"),
or 1 ("none"). FFN is SwiGLU, W2(silu(W1 x) * W3 x), or (MoE layers) shared SwiGLU experts
plus the top-k routed experts (optionally only from the best `num_limited_groups` expert
groups), each fed the token scaled by its router score or scaled after it, as TorchTitan's
MoE computes it. RMSNorm keeps the trained ε (often 1e-12; the final norm may have its
own). RoPE rotates channel halves ("rotate half"), or adjacent channel pairs when
`rope_interleave` says so (DeepSeek's layout), with Llama 3.1's scaling (`llama3_rope_scaling`)
or DeepSeek's YaRN (`yarn_rope_scaling`, which also sharpens the attention softmax) where
the trained model had it. No KV cache: generation recomputes the prefix, which is exact
and fine for evaluation.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_gamma import GammaConfig


def llama3_scaled(inv_freq, scaling):
    """Llama 3.1's RoPE scaling (TorchTitan's llama3 applies it always): wavelengths beyond
    original / low_freq_factor are stretched by `factor`, those below original /
    high_freq_factor kept, the band between interpolated."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def yarn_scaled(inv_freq, yarn, theta):
    """DeepSeek's YaRN (TorchTitan's deepseek_v3 applies it when trained beyond
    `original_max_position_embeddings`): frequencies that turn more than `beta_fast` times
    over the original context are kept, those under `beta_slow` divided by `factor`, a
    linear ramp between."""
    dim, original = 2 * inv_freq.numel(), yarn["original_max_position_embeddings"]

    def correction_dim(rotations):  # the channel whose frequency turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(yarn["beta_slow"])), dim - 1)
    span = high - low if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / span).clamp(0, 1)
    return inv_freq / yarn["factor"] * ramp + inv_freq * (1 - ramp)


def yarn_softmax_factor(yarn):
    """How much YaRN sharpens the attention softmax: mscale² with mscale = 0.1·m·ln(factor) + 1."""
    mscale = 0.1 * yarn["mscale"] * math.log(yarn["factor"]) + 1.0
    return mscale * mscale


def rope_angles(head_dim, positions, theta, scaling=None, yarn=None):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, scaling)
    if yarn is not None:
        inv_freq = yarn_scaled(inv_freq, yarn, theta)
    angles = positions.float()[..., None] * inv_freq  # (batch, seq, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]  # broadcast over heads


def apply_rope(x, cos, sin, interleave=False):
    if interleave:  # channels (2i, 2i + 1) rotate together by angle i; the layout stays interleaved
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).type_as(x)
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)


class GatedHeads(nn.Module):
    """What both attention kinds share: causal (or padding-masked) SDPA, the optional
    output gate on each head, and the output projection `wo`."""

    def _init_output(self, config, value_dim: int) -> None:
        d, heads = config.hidden_size, config.num_attention_heads
        self.gate = config.attention_gate
        self.wo = nn.Linear(heads * value_dim, d, bias=False)
        self.scale = None  # SDPA's 1/sqrt(query width), unless a subclass sets another
        if self.gate != "none":
            self.gate_width = value_dim if self.gate == "elementwise" else 1
            self.gate_proj = nn.Linear(d, heads * self.gate_width, bias=False)

    def _attend(self, x, q, k, v, mask):
        """q, k, v: (bs, seq, heads, ·); x: the block's normed input, which the gate reads."""
        bs, seq, _ = x.shape
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = k.shape[1] != q.shape[1]
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=self.scale)
        out = out.transpose(1, 2)  # (bs, seq, heads, value_dim)
        if self.gate != "none":
            out = out * torch.sigmoid(self.gate_proj(x)).view(bs, seq, -1, self.gate_width)
        return self.wo(out.reshape(bs, seq, -1))


class GammaAttention(GatedHeads):
    def __init__(self, config):
        super().__init__()
        d, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(d, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, kv * self.head_dim, bias=False)
        self.wv = nn.Linear(d, kv * self.head_dim, bias=False)
        if config.qk_norm:  # Qwen 3: each head's query and key RMS-normed before RoPE
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self._init_output(config, self.head_dim)

    def forward(self, x, cos, sin, mask):
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        return self._attend(x, q, k, v, mask)


class GammaMLA(GatedHeads):
    """Multi-head latent attention: queries direct or through a low-rank latent, keys and
    values from one shared latent, plus one rotary key slice shared by all heads."""

    def __init__(self, config):
        super().__init__()
        d, heads, c = config.hidden_size, config.num_attention_heads, config
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.qk_dim, self.kv_lora_rank = self.nope + self.rope_dim, c.kv_lora_rank
        if c.q_lora_rank == 0:
            self.wq = nn.Linear(d, heads * self.qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(d, c.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps)
            self.wq_b = nn.Linear(c.q_lora_rank, heads * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(d, c.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(c.kv_lora_rank, eps=c.rms_norm_eps)
        self.wkv_b = nn.Linear(c.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self._init_output(config, self.v_dim)
        self.interleave = c.rope_interleave
        if c.yarn_rope_scaling is not None:
            self.scale = self.qk_dim ** -0.5 * yarn_softmax_factor(c.yarn_rope_scaling)

    def forward(self, x, cos, sin, mask):
        bs, seq, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(bs, seq, -1, self.qk_dim).split([self.nope, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin, self.interleave)], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, self.interleave)
        k_nope, v = self.wkv_b(self.kv_norm(latent)).view(bs, seq, -1, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return self._attend(x, q, k, v, mask)


class GammaFeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GammaRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.n_routed_experts, bias=config.router_bias)


class GammaExperts(nn.Module):
    """Routed experts stacked as (experts, out, in), as TorchTitan stores them."""

    def __init__(self, config):
        super().__init__()
        e, d, hidden = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.w1 = nn.Parameter(torch.empty(e, hidden, d))
        self.w2 = nn.Parameter(torch.empty(e, d, hidden))
        self.w3 = nn.Parameter(torch.empty(e, hidden, d))


class GammaMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.router = GammaRouter(config)
        self.experts = GammaExperts(config)
        if config.n_shared_experts:
            self.shared_experts = GammaFeedForward(config.hidden_size,
                                                   config.moe_intermediate_size * config.n_shared_experts)
        if config.expert_bias:  # aux-loss-free balancing: shifts which experts are chosen, not their weights
            self.register_buffer("expert_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x):
        c, shape = self.config, x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router.gate(x).float()
        scores = torch.sigmoid(logits) if c.score_func == "sigmoid" else F.softmax(logits, dim=-1)
        choice = scores + self.expert_bias if hasattr(self, "expert_bias") else scores
        if c.num_expert_groups:  # node-limited: only the groups with the best two scores each
            grouped = choice.view(-1, c.num_expert_groups, c.n_routed_experts // c.num_expert_groups)
            best = torch.topk(grouped.topk(2, dim=-1).values.sum(dim=-1), k=c.num_limited_groups, dim=-1,
                              sorted=False).indices
            dropped = torch.ones(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, best, False)
            choice = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(-1, c.n_routed_experts)
        chosen = torch.topk(choice, k=c.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        if c.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * c.route_scale
        out = torch.zeros_like(x)
        w1, w2, w3 = self.experts.w1, self.experts.w2, self.experts.w3
        for e in range(c.n_routed_experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                weight = weights[token, slot, None]
                inp = (x[token].float() * weight).to(x.dtype) if c.score_before_experts else x[token]
                y = (F.silu(inp @ w1[e].T) * (inp @ w3[e].T)) @ w2[e].T
                out.index_add_(0, token, y if c.score_before_experts else (y.float() * weight).to(x.dtype))
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out.reshape(shape)


class GammaBlock(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = GammaMLA(config) if config.attention == "mla" else GammaAttention(config)
        self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.moe_enabled = config.n_routed_experts > 0 and layer_id >= config.n_dense_layers
        if self.moe_enabled:
            self.moe = GammaMoE(config)
        else:
            self.feed_forward = GammaFeedForward(config.hidden_size, config.intermediate_size)

    def forward(self, h, cos, sin, mask):
        h = h + self.attention(self.attention_norm(h), cos, sin, mask)
        return h + (self.moe if self.moe_enabled else self.feed_forward)(self.ffn_norm(h))


class GammaPreTrainedModel(PreTrainedModel):
    config_class = GammaConfig
    base_model_prefix = "model"
    _no_split_modules = ["GammaBlock"]

    def _init_weights(self, module):
        pass  # weights always come from a converted checkpoint


class GammaModel(GammaPreTrainedModel):
    def __init__(self, config, block_class=GammaBlock):
        super().__init__(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(block_class(config, i) for i in range(config.num_hidden_layers))
        final_eps = config.rms_norm_eps if config.final_norm_eps is None else config.final_norm_eps
        # "dtype": PyTorch's RMSNorm default, the input dtype's machine epsilon (TorchTitan's deepseek_v3)
        self.norm = nn.RMSNorm(config.hidden_size, eps=None if final_eps == "dtype" else final_eps)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bs, seq = input_ids.shape
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):  # padding: causal AND real keys
            causal = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).tril()
            mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
            mask = mask | torch.eye(seq, dtype=torch.bool, device=input_ids.device)  # no empty rows
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device).expand(bs, seq)
        c = self.config
        rope_dim = c.qk_rope_head_dim if c.attention == "mla" else c.head_dim
        cos, sin = rope_angles(rope_dim, position_ids, c.rope_theta, c.llama3_rope_scaling, c.yarn_rope_scaling)
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.norm(h)


class GammaForCausalLM(GammaPreTrainedModel, GenerationMixin):
    #: The block (config, layer_id) -> module with forward(h, cos, sin, mask): a family with
    #: another block shape subclasses this class in a file of its own package.
    block_class = GammaBlock

    def __init__(self, config):
        super().__init__(config)
        self.model = GammaModel(config, self.block_class)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def get_output_embeddings(self):
        return self.output

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}  # no cache: the whole prefix

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None, **kwargs):
        logits = self.output(self.model(input_ids, attention_mask, position_ids)).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
