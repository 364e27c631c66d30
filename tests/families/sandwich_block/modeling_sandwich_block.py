"""The sandwich block for transformers (trust_remote_code), next to the shared package's
modeling_gamma.py in a converted folder: three sublayers, each between a pre- and a post-norm."""

from torch import nn

try:  # in a converted folder, next to the shared package's files
    from .modeling_gamma import GammaAttention, GammaFeedForward, GammaForCausalLM
except ImportError:  # in the family's own folder, where gamma_titan holds them
    from gamma_titan.convert.hf_package.modeling_gamma import GammaAttention, GammaFeedForward, GammaForCausalLM

SUBLAYERS = ("feed_forward_in", "attention", "feed_forward")


class SandwichBlock(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.feed_forward_in = GammaFeedForward(config.hidden_size, config.intermediate_size)
        self.attention = GammaAttention(config)
        self.feed_forward = GammaFeedForward(config.hidden_size, config.intermediate_size)
        self.norms = nn.ModuleDict({f"{side}_{sublayer}": nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
                                    for sublayer in SUBLAYERS for side in ("pre", "post")})

    def forward(self, h, cos, sin, mask):
        n = self.norms
        h = h + n["post_feed_forward_in"](self.feed_forward_in(n["pre_feed_forward_in"](h)))
        h = h + n["post_attention"](self.attention(n["pre_attention"](h), cos, sin, mask))
        return h + n["post_feed_forward"](self.feed_forward(n["pre_feed_forward"](h)))


class SandwichBlockForCausalLM(GammaForCausalLM):
    block_class = SandwichBlock
    _no_split_modules = ["SandwichBlock"]
