"""The parallel block for transformers (trust_remote_code), next to the shared package's
modeling_gamma.py in a converted folder: h + Attn(x) + FFN(x), x = RMSNorm(h)."""

from torch import nn

try:  # in a converted folder, next to the shared package's files
    from .modeling_gamma import GammaAttention, GammaFeedForward, GammaForCausalLM
except ImportError:  # in the family's own folder, where gamma_titan holds them
    from gamma_titan.convert.hf_package.modeling_gamma import GammaAttention, GammaFeedForward, GammaForCausalLM


class ParallelBlock(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = GammaAttention(config)
        self.feed_forward = GammaFeedForward(config.hidden_size, config.intermediate_size)

    def forward(self, h, cos, sin, mask):
        x = self.norm(h)
        return h + self.attention(x, cos, sin, mask) + self.feed_forward(x)


class ParallelBlockForCausalLM(GammaForCausalLM):
    block_class = ParallelBlock
    _no_split_modules = ["ParallelBlock"]
