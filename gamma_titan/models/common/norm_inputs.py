"""What each RMSNorm of a model sees at initialisation: σ²(h) = mean h² of its input,
measured by a forward pass of a fixed batch through the model as built and initialised for
training. This, not the embedding's d^(−2γ), is what ε competes with: a norm after a
sublayer (a post-norm, h + norm(f(norm(h)))) sees f's output, far smaller at γ = 1.

The model is built on the meta device and materialised one part at a time (embedding,
then each block), each initialised exactly as in training (same per-parameter seeds),
run, and freed, so a 7B model walks in a few GB of CPU memory. A TorchTitan model without
[gamma] init_rate keeps TorchTitan's init, which initialises the whole model at once: it
is materialised whole (less the blocks a short walk skips).

`inspect` walks every block and the head (gamma_titan/inspect_model.py); the recipe planner
walks the shortest run of leading blocks that holds one of each kind (`blocks_of_each_kind`),
the last only up to its last norm (`norm_inputs_at_init`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from gamma_titan.init import GammaInit, ParamInit, draw_segments, gamma_init_, init_plan

from .decoder import reset_buffers
from .masks import eager_reading

#: The probe batch: sequences x tokens (at most the run's seq_len), drawn from `seed`.
PROBE_BATCH = 2
PROBE_LEN = 128
#: A short walk's tokens come from the vocabulary's first rows, so that the embedding's draw
#: is the few chunks holding them rather than vocab x d values (all rows are drawn alike).
PROBE_VOCAB = 1024


@dataclass
class InitForward:
    norm_inputs: dict[str, float]  # RMSNorm -> σ²(h) of its input, in the order the forward meets them
    embedding: torch.Tensor  # e = Embed(tokens), float32
    hidden: torch.Tensor  # h after the blocks walked (before the last, where the walk stopped in it)
    logits: torch.Tensor | None  # with the head only

    def smallest(self) -> tuple[str, float]:
        """The norm whose input has the smallest variance, and that variance: where ε
        dominates first."""
        return min(self.norm_inputs.items(), key=lambda site: site[1])


def probe_seed(args) -> int:
    """The init seed the walk uses: the run's γ-init seed, else 0."""
    return 0 if args.init is None or args.init.seed is None else args.init.seed


def probe_tokens(vocab_size: int, seq_len: int, seed: int, batch: int = PROBE_BATCH,
                 length: int = PROBE_LEN) -> torch.Tensor:
    """The probe batch: `batch` sequences of up to `length` token ids below `vocab_size`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, min(length, seq_len)), generator=gen)


def blocks_of_each_kind(model: nn.Module) -> int:
    """The number of leading blocks that holds one block of each kind (kind: the block's
    module classes and parameter shapes; dense then MoE blocks are two kinds). The first
    block of a kind sees the smallest inputs its kind sees at init: the residual stream
    only grows along the depth, and a sublayer's output (a post-norm's input) is smallest
    where its input's positions are least alike, the embedded tokens (measured on every
    config's debug flavor and the fixture families at γ 0.5, 1, 1.5: the smallest norm
    input of the whole model is the smallest over these blocks, to 6 digits)."""
    first: dict[tuple, int] = {}
    for i, block in enumerate(model.layers.values()):
        kind = (tuple((name, type(m).__name__) for name, m in block.named_modules()),
                tuple((name, tuple(p.shape)) for name, p in block.named_parameters()))
        first.setdefault(kind, i)
    return max(first.values()) + 1


def param_plan(module: nn.Module, cfg: GammaInit | None, rule, prefix: str = "") -> list[ParamInit]:
    """The γ plan, or under TorchTitan's init (cfg None) each parameter's group and fan-in."""
    if cfg is not None:
        return init_plan(module, cfg, rule, prefix)
    return [ParamInit(prefix + name, *rule(prefix + name, tuple(p.shape)), None)
            for name, p in module.named_parameters()]


@contextmanager
def norm_input_hooks(module: nn.Module, prefix: str, sites: dict[str, float]):
    """Forward pre-hooks on every RMSNorm under `module` that record σ²(h) = mean h² of
    its input into `sites`, under its name in the full model."""
    def record(site: str):
        def hook(norm, inputs):
            sites[site] = inputs[0].detach().float().pow(2).mean().item()

        return hook

    handles = [sub.register_forward_pre_hook(record(f"{prefix}{name}" if name else prefix.rstrip(".")))
               for name, sub in module.named_modules() if isinstance(sub, nn.RMSNorm)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _AllNormsSeen(Exception):
    """The last block walked has recorded every norm input it has: the rest of it is not needed."""


def _up_to_last_norm(layer: nn.Module, prefix: str, h: torch.Tensor, block_inputs: tuple, sites: dict[str, float],
                     draw: Callable[[nn.Module, str], None]) -> bool:
    """Run `layer` (on meta) until its last norm has recorded its input, drawing each of its
    children as its forward is first called: what follows the last norm (a pre-norm MoE
    block's routed experts, most of its values) is never drawn. False where the block's
    forward reads a child's weights without calling it (they are still on meta)."""
    norms = {f"{prefix}{name}" for name, m in layer.named_modules() if isinstance(m, nn.RMSNorm)}
    drawn: set[str] = set()

    def draw_once(name: str):
        def hook(child, inputs):
            if name not in drawn:
                drawn.add(name)
                draw(child, f"{prefix}{name}.")

        return hook

    def stop(norm, inputs):
        if norms <= sites.keys():
            raise _AllNormsSeen

    handles = [child.register_forward_pre_hook(draw_once(name)) for name, child in layer.named_children()]
    try:
        with norm_input_hooks(layer, prefix, sites):  # after the drawing hooks, before `stop`
            handles += [m.register_forward_pre_hook(stop) for m in layer.modules() if isinstance(m, nn.RMSNorm)]
            layer(h, *block_inputs)
        return True
    except _AllNormsSeen:
        return True
    except (NotImplementedError, RuntimeError):  # PyTorch's errors for a meta tensor among CPU ones
        return False
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def forward_at_init(model: nn.Module, cfg: GammaInit | None, seed: int, tokens: torch.Tensor, *,
                    n_blocks: int | None = None, head: bool = True, embedding_rows_only: bool = False,
                    stop_at_last_norm: bool = False, tokenizer=None,
                    on_part: Callable[[nn.Module, list[ParamInit]], None] | None = None) -> InitForward:
    """Walk `model` (built on meta) at init over `tokens`: the embedding, the first
    `n_blocks` blocks (all by default), and with `head` the final norm and the output.
    `cfg` is the γ-init (its seed `seed`), None for TorchTitan's own init. `on_part(part,
    plan)` is called for each part once it holds its initial values, except an embedding
    of which `embedding_rows_only` draws just the rows `tokens` look up, and a last block
    that `stop_at_last_norm` runs only up to its last norm (neither with `head`). A model
    that takes attention masks (flex) gets the trainer's, from `tokenizer`'s EOS."""
    if head and (embedding_rows_only or stop_at_last_norm):
        raise ValueError("the head needs the whole embedding (when tied) and the last block's output")
    titan_init = cfg is None
    rule = model.init_rule
    sites: dict[str, float] = {}
    if titan_init:
        if n_blocks is not None:  # TorchTitan's init draws the blocks in order: the first keep their values
            for key in list(model.layers)[n_blocks:]:
                del model.layers[key]
        torch.manual_seed(seed)
        model.to_empty(device="cpu")
        model.init_weights(buffer_device="cpu")

    def materialise(part: nn.Module, prefix: str) -> None:
        if titan_init:
            plan = param_plan(part, None, rule, prefix)
        else:
            part.to_empty(device="cpu")
            reset_buffers(part, "cpu")  # MoE expert bias and load counters: garbage after to_empty
            plan = gamma_init_(part, cfg, rule, prefix)
        if on_part is not None:
            on_part(part, plan)

    def release(part: nn.Module) -> None:
        if not titan_init:
            part.to_empty(device="meta")  # free it before the next one

    emb = model.tok_embeddings
    tied = model.output.weight is emb.weight  # a tied head is the embedding: drawn and listed once
    if embedding_rows_only and not titan_init:
        e = _embedding_rows(emb, cfg, rule, tokens)
    else:
        materialise(emb, "tok_embeddings.")
        e = emb(tokens).float()
        tied_head = emb.weight.detach().clone() if tied and head else None
        release(emb)

    block_inputs = model.block_inputs(tokens, "cpu", tokenizer)
    h = e
    blocks = list(model.layers.items())[:n_blocks]
    for i, layer in blocks:
        prefix = f"layers.{i}."
        own = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]  # drawn by no child's hook
        with eager_reading():
            stopped = (stop_at_last_norm and i == blocks[-1][0] and not own
                       and _up_to_last_norm(layer, prefix, h, block_inputs, sites, materialise))
            if not stopped:
                materialise(layer, prefix)
                with norm_input_hooks(layer, prefix, sites):
                    h = layer(h, *block_inputs)
        release(layer)

    logits = None
    if head:
        for name in ("norm", *([] if tied else ["output"])):
            materialise(getattr(model, name), f"{name}.")
        with norm_input_hooks(model.norm, "norm.", sites):
            logits = model.norm(h) @ tied_head.T if tied else model.output(model.norm(h))
    return InitForward(sites, e, h, logits)


def norm_kind(site: str) -> str:
    """A block norm's name with the block's index starred ("layers.*.attention_norm"): a
    walk over the first block of each kind measures it for the blocks of that kind."""
    return re.sub(r"^layers\.\d+\.", "layers.*.", site)


def _embedding_rows(emb: nn.Embedding, cfg: GammaInit, rule, tokens: torch.Tensor) -> torch.Tensor:
    """Embed(tokens) from the rows they look up, drawn as γ-init draws them (the same
    values as the whole table's), without the table."""
    entry = init_plan(emb, cfg, rule, "tok_embeddings.")[0]
    rows = tokens.unique()  # sorted
    width = emb.weight.shape[1]
    values, _ = draw_segments(entry, emb.weight.numel(), cfg.seed, rows * width, torch.full_like(rows, width),
                              cfg.truncation)
    return nn.functional.embedding(torch.searchsorted(rows, tokens), values.view(-1, width))


def norm_inputs_at_init(model_cls: Callable[..., nn.Module], args, seq_len: int) -> InitForward:
    """σ²(h) at each norm input of the model `args` build, at init, over the leading blocks
    that hold one of each kind (`blocks_of_each_kind`; the final norm sees the last
    block's output, no smaller): at the model's own width, wiring and init, in float32 on
    the CPU, over 2 x 128 tokens. The cost is the values drawn (12 ns each, init.py): the
    embedding's rows the tokens use, the blocks, the last one up to its last norm (not a
    pre-norm block's feed-forward or routed experts). Measured on 2 busy cores: 0.05-0.3 s
    for the tiny, debug and gpu configs, 1-1.5 s for 1.5B dense, 7B and the paper MoE
    ones, 3.4 s (1 GB) for 16B-A2.4B.

    At a post-attention norm σ²(h) falls with the sequence length (attention at init
    averages over the prefix): 128 tokens give an upper bound there."""
    seed = probe_seed(args)
    cfg = None if args.init is None else dataclasses.replace(args.init, seed=seed)
    with torch.device("meta"):
        model = model_cls(args)
    tokens = probe_tokens(min(args.vocab_size, PROBE_VOCAB), seq_len, seed)
    return forward_at_init(model, cfg, seed, tokens, n_blocks=blocks_of_each_kind(model), head=False,
                           embedding_rows_only=True, stop_at_last_norm=True)
