"""The attention masks the trainer builds, for the readers that run a model outside a
training step: the init walk (`inspect`, the start-up summary) and the live diagnostics'
probe.

TorchTitan's Trainer asks `model.get_attention_masks(batch, tokenizer)` of a model whose
args take masks (`takes_attention_masks`: flex attention, whose block-causal mask keeps
each document to itself, split after each of the tokenizer's EOS tokens); SDPA's causal
mask is its own. A reader that ran a flex model without its mask would measure it
attending both ways (measured: residual flow 0.147 at init against 0.346 causal).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch import nn

#: What torch says once when flex attention runs uncompiled (the readers here do, on purpose).
EAGER_FLEX_WARNING = "flex_attention called without torch.compile"


def trainer_masks(model: nn.Module, tokens: torch.Tensor, tokenizer) -> object | None:
    """The masks the trainer would build for `tokens` (None: the model needs none), built
    eagerly: TorchTitan compiles `create_block_mask` for its steps, which a one-off reader
    need not pay for. `tokenizer`: anything with the run's `eos_id`."""
    if not model.model_args.takes_attention_masks():
        return None
    if getattr(tokenizer, "eos_id", None) is None:
        raise ValueError(f"{type(model).__name__} takes block-causal attention masks: they need the run's tokenizer "
                         "(its eos_id)")
    with torch.compiler.set_stance("force_eager"):
        return model.get_attention_masks(tokens, tokenizer)


@contextmanager
def eager_reading():
    """The init walk's forward: compiled code bypassed (no compilation for the walk's
    shapes; flex attention's own compiled kernel excepted on a GPU, models/titan/knobs.py),
    and torch's warning about uncompiled flex attention silenced. (The live diagnostics
    bypass compiled code too, on the run's device.)"""
    with warnings.catch_warnings(), torch.compiler.set_stance("force_eager"):
        warnings.filterwarnings("ignore", message=EAGER_FLEX_WARNING)
        yield
