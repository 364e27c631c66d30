"""gamma-titan's dense decoder with gated attention, for transformers (trust_remote_code).

Written by `gamma-titan convert to-hf`; needs only torch and transformers. The same model
as gamma_titan.models.dense, top to bottom:

    h = embed(tokens)
    h = h + Wo( gate(x) * attention(RoPE(Wq x), RoPE(Wk x), Wv x) ),  x = RMSNorm(h)
    h = h + W2( silu(W1 x) * W3 x ),                                   x = RMSNorm(h)
    logits = Output(RMSNorm(h))

gate(x) = sigmoid(Wg x), one value per head ("headwise") or per channel ("elementwise"),
or 1 ("none"). RMSNorm keeps the trained ε (often 1e-12). No KV cache: generation
recomputes the prefix, which is exact and fine for evaluation.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_gamma import GammaConfig


def rope_angles(head_dim, positions, theta):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq  # (batch, seq, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]  # broadcast over heads


def apply_rope(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)


class GammaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.gate = d // heads, config.attention_gate
        self.wq = nn.Linear(d, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, kv * self.head_dim, bias=False)
        self.wv = nn.Linear(d, kv * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, d, bias=False)
        if self.gate != "none":
            self.gate_width = self.head_dim if self.gate == "elementwise" else 1
            self.gate_proj = nn.Linear(d, heads * self.gate_width, bias=False)

    def forward(self, x, cos, sin, mask):
        bs, seq, _ = x.shape
        q = apply_rope(self.wq(x).view(bs, seq, -1, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(self.wk(x).view(bs, seq, -1, self.head_dim), cos, sin).transpose(1, 2)
        v = self.wv(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        gqa = k.shape[1] != q.shape[1]
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        out = out.transpose(1, 2)  # (bs, seq, heads, head_dim)
        if self.gate != "none":
            out = out * torch.sigmoid(self.gate_proj(x)).view(bs, seq, -1, self.gate_width)
        return self.wo(out.reshape(bs, seq, -1))


class GammaFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GammaBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = GammaAttention(config)
        self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.feed_forward = GammaFeedForward(config)

    def forward(self, h, cos, sin, mask):
        h = h + self.attention(self.attention_norm(h), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class GammaPreTrainedModel(PreTrainedModel):
    config_class = GammaConfig
    base_model_prefix = "model"
    _no_split_modules = ["GammaBlock"]

    def _init_weights(self, module):
        pass  # weights always come from a converted checkpoint


class GammaModel(GammaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GammaBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
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
        cos, sin = rope_angles(self.config.hidden_size // self.config.num_attention_heads, position_ids,
                               self.config.rope_theta)
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.norm(h)


class GammaForCausalLM(GammaPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = GammaModel(config)
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
