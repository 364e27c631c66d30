"""gamma_sandwich: sandwich normalization (CogView, Ding et al. 2021; Gemma 2) around the
three sublayers of a Macaron block (Lu et al. 2019), with the paper's three knobs:

    h = h + post(FFN_in(pre(h)));  h = h + post(Attn(pre(h)));  h = h + post(FFN(pre(h)))

It differs from parallel_block where the shared code could assume too much: norms whose
output joins the residual stream (the post-norms: the TP plan, the variance a norm sees at
init), norms held in a container rather than as the block's children, and three
sublayers, one kind twice. Everything else is shared, as in parallel_block."""

from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.models.common.parallelize import parallelize_decoder
from gamma_titan.models.common.train_spec import family_train_spec

from .model import SandwichBlockArgs, SandwichBlockLM, SandwichBlockStateDictAdapter, sandwich_flavors

#: The name its entry point registers it under (tests/conftest.py installs it).
NAME = "gamma_sandwich"


def get_train_spec() -> TrainSpec:
    return family_train_spec(SandwichBlockLM, sandwich_flavors, parallelize_decoder, SandwichBlockStateDictAdapter)


__all__ = ["NAME", "SandwichBlockArgs", "SandwichBlockLM", "get_train_spec"]
