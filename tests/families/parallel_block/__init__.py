"""gamma_parallel: PaLM's parallel block (Chowdhery et al. 2022, §2) with the paper's three
knobs, built from models/common as a new family would be, outside the package:

    h = h + Attn(x) + SwiGLU(x),   x = RMSNorm(h)      (one norm per block)

Everything else is shared: the decoder skeleton, gated attention, SwiGLU, the args'
fields and counts (AttentionFFNArgs), parallelize_decoder, and the Hugging Face package,
which gets this folder's block (modeling_parallel_block.py)."""

from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.models.common.parallelize import parallelize_decoder
from gamma_titan.models.common.train_spec import family_train_spec

from .model import ParallelBlockArgs, ParallelBlockLM, ParallelBlockStateDictAdapter, parallel_flavors

#: The name its entry point registers it under (tests/conftest.py installs it).
NAME = "gamma_parallel"


def get_train_spec() -> TrainSpec:
    return family_train_spec(ParallelBlockLM, parallel_flavors, parallelize_decoder, ParallelBlockStateDictAdapter)


__all__ = ["NAME", "ParallelBlockArgs", "ParallelBlockLM", "get_train_spec"]
