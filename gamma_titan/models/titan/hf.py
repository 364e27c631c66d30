"""The Hugging Face names every TorchTitan family here shares: the gate projection's key,
and renaming between TorchTitan's names and a family's HF names by its adapter's table
(`from_hf_map`, layer numbers abstracted as "{}")."""

from __future__ import annotations

import re
from typing import Any

#: The gate projection under HF names (as GammaForCausalLM and the families' maps spell it).
GATE_HF = "model.layers.{}.self_attn.gate_proj.weight"
GATE_TITAN = "layers.{}.attention.gate_proj.weight"
_LAYER = re.compile(r"(\d+)")


def rename(key: str, table: dict[str, str]) -> str:
    """`key` through `table`, whose keys have the layer number as "{}"."""
    layer = _LAYER.search(key)
    return table[_LAYER.sub("{}", key, count=1)].format(layer.group(0)) if layer else table[key]


def renamed(state: dict[str, Any], table: dict[str, str]) -> dict[str, Any]:
    return {rename(k, table): v for k, v in state.items()}


def inverse(table: dict[str, str | None]) -> dict[str, str]:
    return {v: k for k, v in table.items() if v is not None}
