"""The decoder skeleton every gamma_titan model shares.

    h_0 = e = Embed(tokens)
    h_l = block_l(h_{l-1}, rope)        (pre-norm attention + feed-forward, per family)
    logits = Output(RMSNorm(h_L))

Untied embeddings, no biases, no dropout. A family (dense, MoE) supplies its blocks; every
parameter's γ group and fan-in are declared by the module that holds it (`GAMMA_GROUPS`,
`FAN_IN_DIM`: `declared_init_rule`), and initialisation is the γ rule of
gamma_titan/init.py for every parameter.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.protocols.model import ModelProtocol

from gamma_titan.init import InitRule, canonical_name, gamma_init_, standard_fan_in

from .rope import rope_at, rope_cache


def declared_init_rule(model: nn.Module) -> InitRule:
    """The `InitRule` (gamma_titan/init.py) the modules of `model` declare; no module name is
    assumed. A module's `GAMMA_GROUPS` maps the names of the parameters under it (relative,
    by prefix, "" for the rest) to a γ group, and the innermost declaring module decides; a
    module's `FAN_IN_DIM` is the dimension its own weights contract (routed experts stored
    (experts, out, in): -1), else `standard_fan_in`. Norm scales (1-D) are filled with 1."""
    groups, fan_in_dims = {}, {}
    for prefix, module in model.named_modules():  # outer modules first: inner ones override
        declared = getattr(module, "GAMMA_GROUPS", None)
        for name, _ in module.named_parameters() if declared else ():
            match = max((p for p in declared if name.startswith(p)), key=len, default=None)
            if match is not None:
                groups[canonical_name(f"{prefix}.{name}" if prefix else name)] = declared[match]
        if getattr(module, "FAN_IN_DIM", None) is not None:
            for name, _ in module.named_parameters(recurse=False):
                fan_in_dims[canonical_name(f"{prefix}.{name}" if prefix else name)] = module.FAN_IN_DIM

    def rule(name: str, shape: tuple[int, ...]) -> tuple[str, int | None]:
        fan_in = shape[fan_in_dims[name]] if name in fan_in_dims else standard_fan_in(shape)
        if fan_in is None:
            return "norm", None
        if name not in groups:
            raise KeyError(f"no γ group for parameter {name!r}: no module above it declares one in GAMMA_GROUPS")
        return groups[name], fan_in

    return rule


class DecoderLM(ModelProtocol):
    def __init__(self, args, blocks: list[nn.Module], rope_dim: int):
        super().__init__(args)
        self.model_args = args
        self.rope_dim = rope_dim
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", self._rope_cache(), persistent=False)

    def _rope_cache(self, device=None) -> torch.Tensor:
        a = self.model_args
        return rope_cache(self.rope_dim, a.max_seq_len, a.rope_theta, device=device)

    def forward(self, tokens: torch.Tensor, attention_masks: None = None, positions: torch.Tensor | None = None, *,
                head: bool = True) -> torch.Tensor:
        """Logits; with `head=False`, the final norm's output instead (for readers of the
        activations, such as the diagnostics' probe, which need no vocabulary matmul).

        `positions` (batch, seq) are the tokens' places in their sequences when they are
        not 0..seq-1: TorchTitan's context parallelism passes each rank's (its chunks of the
        sequence) and runs the attention's SDPA module as ring attention.

        A pipeline stage (TorchTitan's pipeline_module_split) holds some of the blocks and
        None for the embedding, norm or output it lacks: a stage without the embedding
        takes the previous stage's hidden states as `tokens`, one without the head returns
        hidden states."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # the whole cache (attention takes its sequence's positions), or each token's rows
        rope = self.rope if positions is None else rope_at(self.rope, positions)
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if head and self.output is not None else h

    @property
    def freqs_cis(self) -> torch.Tensor:
        """The rotary cache under TorchTitan's name: its 0.2 validator reads `freqs_cis` of
        every model part under context parallelism (for a context it then never enters)."""
        return self.rope

    def block_inputs(self, tokens: torch.Tensor, device, tokenizer=None) -> tuple:
        """What each block takes after the hidden states, for a reader running the blocks
        one by one over `tokens` (inspect): the rotary cache, rebuilt on `device` (causal
        SDPA: no masks, so no tokenizer)."""
        self.rope = self._rope_cache(device=device)
        return (self.rope[:tokens.shape[1]],)

    def get_attention_masks(self, input_batch, tokenizer, extra_inputs=None) -> None:
        """Causal SDPA needs no mask object (TorchTitan's validator asks for one)."""
        return None

    # --- initialisation -------------------------------------------------------------

    #: The γ groups of the skeleton's own weights (a block's modules declare theirs).
    GAMMA_GROUPS = {"tok_embeddings.": "embedding", "output.": "output"}

    @property
    def init_rule(self) -> InitRule:
        """(γ group, fan-in) of each parameter, as the modules declare them."""
        return declared_init_rule(self)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Called by TorchTitan after the model is materialised (and sharded)."""
        device = buffer_device or self.rope.device
        self.rope = self._rope_cache(device=device)
        reset_buffers(self, device)
        gamma_init_(self, self.model_args.init, self.init_rule)


def reset_buffers(module: nn.Module, device) -> None:
    """Give every submodule with state buffers (MoE load counters, expert bias) its
    initial state; after `to_empty` they hold garbage."""
    for sub in module.modules():
        if hasattr(sub, "reset_buffers"):
            sub.reset_buffers(device)
