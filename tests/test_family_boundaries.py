"""A model family lives in one folder: code outside gamma_titan/models/ asks the family's
args (GammaArgs) and never names a family-specific field or tests a family by name.

Family-specific: a field of some registered family's args but not of all, and the names
the families register under. The Hugging Face package's modeling code
(convert/hf_package/, which must stand alone) is the one exception.
"""

from __future__ import annotations

import io
import tokenize
from dataclasses import fields
from pathlib import Path

from gamma_titan.models import TRAIN_SPECS

PACKAGE = Path(__file__).resolve().parents[1] / "gamma_titan"
EXEMPT = (PACKAGE / "models", PACKAGE / "convert" / "hf_package")


#: Field names that are also everyday names outside any family: gamma_moe's `attention`
#: (MHA or MLA) is also the attention module's name (`layers.0.attention.wo`) and a γ group;
#: llama3's `eos_id` is also every tokenizer's; TorchTitan's MoE families' copy of
#: `expert_parallel_comm_backend` is also the [parallelism] key it is copied from.
COMMON_WORDS = {"attention", "eos_id", "expert_parallel_comm_backend"}


def family_specific_names() -> set[str]:
    per_family = [{f.name for f in fields(type(next(iter(spec.model_args.values()))))}
                  for spec in TRAIN_SPECS.values()]
    shared = set.intersection(*per_family)
    return (set.union(*per_family) - shared - COMMON_WORDS) | set(TRAIN_SPECS)


def uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) for each attribute access `.name` and each string literal that is
    exactly a name (a dict key, getattr, a comparison with the model name)."""
    found, previous = [], None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.string in names and previous == ".":
            found.append((token.start[0], token.string))
        elif token.type == tokenize.STRING:
            text = token.string.lstrip("rbuRBU")
            value = text.strip("'\"") if not text.startswith(("'''", '"""')) else None
            if value in names:
                found.append((token.start[0], value))
        if token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            previous = token.string
    return found


def test_the_checker_sees_fields_and_names():
    names = {"n_routed_experts", "gamma_moe"}
    source = 'x = args.n_routed_experts\ny = getattr(a, "n_routed_experts")\nif name == "gamma_moe": pass\n'
    assert uses(source, names) == [(1, "n_routed_experts"), (2, "n_routed_experts"), (3, "gamma_moe")]
    assert uses('"""n_routed_experts in a sentence"""\n# args.n_routed_experts\n', names) == []


def test_family_specific_names_stay_in_their_family():
    names = family_specific_names()
    assert {"n_routed_experts", "kv_lora_rank", "gamma_dense", "gamma_moe"} <= names
    assert "dim" not in names and "norm_eps" not in names
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(path.is_relative_to(root) for root in EXEMPT):
            continue
        offenders += [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
                      for line, name in uses(path.read_text(encoding="utf-8"), names)]
    assert not offenders, "family-specific names outside gamma_titan/models/:\n" + "\n".join(offenders)
