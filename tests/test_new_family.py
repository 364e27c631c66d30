"""A new model family is one folder and one line: tests/families/parallel_block (PaLM's
parallel block, one norm per block) is registered by one entry-point line (tests/conftest.py
installs the fixture families for the session, as a package of one's own would), and nothing
in the package knows it. Here: it is registered by its entry point alone, inspected through
the project's command, and its TP plan and γ rule are read off its modules. Its training on
1 process, FSDP 2, TP 2 and PP 2, its live diagnostics and its Hugging Face form are the
family matrix's, as every registered family's (tests/test_families.py); the second fixture,
tests/families/sandwich_block (post-norms in a container, three sublayers), is checked there
and below."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import REPO

from families import fixture_names
from families.parallel_block import NAME, ParallelBlockArgs, ParallelBlockLM
from families.parallel_block.model import parallel_flavors
from gamma_titan.models import FAMILY_ENTRY_POINTS, TRAIN_SPECS


def gamma_titan(*argv) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "gamma_titan.cli", *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_the_fixture_families_are_registered_by_their_entry_points_alone():
    """Each is in the registry, from its entry point (group FAMILY_ENTRY_POINTS), and the
    package's own registry names none of them."""
    from importlib.metadata import entry_points

    installed = {e.name: e.value for e in entry_points(group=FAMILY_ENTRY_POINTS)}
    own = (REPO / "gamma_titan" / "models" / "__init__.py").read_text()
    for name, folder in fixture_names().items():
        assert installed[name] == f"families.{folder}:get_train_spec"
        assert TRAIN_SPECS[name].model_cls.__module__ == f"families.{folder}.model"
        assert name not in own
    assert {"gamma_parallel", "gamma_sandwich"} <= set(fixture_names())


def test_inspect_counts_one_norm_per_block():
    report = json.loads(gamma_titan("inspect", REPO / "configs" / "dense" / "debug.toml", "--json",
                                    "--model.name", NAME).stdout)
    args = parallel_flavors["debug"]  # the config's flavor
    norms = args.n_layers * args.dim + args.dim  # one per block, then the final norm
    assert report["model"] == "ParallelBlockLM"
    assert report["n_params"] == args.vocab_size * args.dim + norms + args.matmul_params()
    groups = {row["group"] for row in report["params"]}
    assert groups == {"embedding", "norm", "attention", "gate", "ffn", "output"}


def test_a_block_child_without_a_tp_plan_is_refused_and_its_own_plan_is_used():
    """The TP plan is read off the block's children: norms, shared modules by type, a
    module's own `tensor_parallel_plan`; anything else with weights is refused by name."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from gamma_titan.models.common.parallelize import TPStyles, children_tp_plan

    styles = TPStyles(ColwiseParallel, RowwiseParallel, PrepareModuleInput, mesh=None)
    block = ParallelBlockLM(ParallelBlockArgs(dim=64, n_layers=1, n_heads=4, ffn_hidden_dim=96, vocab_size=64)).layers["0"]
    plan = children_tp_plan(block, styles)
    assert isinstance(plan["norm"], SequenceParallel)
    assert {"attention", "attention.wq", "attention.wo", "attention.gate_proj", "feed_forward",
            "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"} <= set(plan)

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64, bias=False)

        def tensor_parallel_plan(self, styles):
            return {"proj": styles.colwise()}

    block.extra = Scale()
    assert isinstance(children_tp_plan(block, styles)["extra.proj"], ColwiseParallel)
    block.extra = nn.Linear(64, 64)
    with pytest.raises(ValueError, match="no plan for Linear \\('extra' of ParallelBlock\\)"):
        children_tp_plan(block, styles)

    class DTensorNorm(nn.RMSNorm):  # a shared type with a plan of its own: its plan, not the type's
        def tensor_parallel_plan(self, styles):
            return {"": SequenceParallel(use_local_output=False)}

    block.extra = DTensorNorm(64)
    style = children_tp_plan(block, styles)["extra"]
    assert isinstance(style, SequenceParallel) and not style.use_local_output


def test_norms_anywhere_in_a_block_are_planned_to_go_anywhere():
    """gamma_sandwich's six norms sit in a ModuleDict, three of them post-norms whose output
    joins the residual stream: each is sequence parallel with a local output (the stream's
    form between planned modules), and a weight inside a container that no rule plans is
    refused by its path. (The TP 2 run that needs it: tests/test_families.py.)"""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from families.sandwich_block import SandwichBlockLM
    from families.sandwich_block.model import SUBLAYERS, sandwich_flavors
    from gamma_titan.models.common.parallelize import DECODER_CHILDREN, TPStyles, children_tp_plan

    styles = TPStyles(ColwiseParallel, RowwiseParallel, PrepareModuleInput, mesh=None)
    with torch.device("meta"):
        model = SandwichBlockLM(sandwich_flavors["debug"])
    plan = children_tp_plan(model.layers["0"], styles)
    norms = {f"norms.{side}_{sublayer}" for sublayer in SUBLAYERS for side in ("pre", "post")}
    assert norms <= set(plan) and all(isinstance(plan[n], SequenceParallel) and plan[n].use_local_output for n in norms)
    assert {"feed_forward_in.w1", "attention.wq", "feed_forward.w2"} <= set(plan)
    model.layers["0"].norms["odd"] = nn.Linear(64, 64)
    with pytest.raises(ValueError, match="no plan for Linear \\('odd' of ModuleDict\\)"):
        children_tp_plan(model.layers["0"], styles)
    # the decoder's own children are apply_tp's; anything a family adds at the top is planned or refused alike
    assert children_tp_plan(model, styles, skip=DECODER_CHILDREN) == {}
    model.embedding_norm = nn.RMSNorm(64)
    assert isinstance(children_tp_plan(model, styles, skip=DECODER_CHILDREN)["embedding_norm"], SequenceParallel)
    model.extra_head = nn.Linear(64, 64)
    with pytest.raises(ValueError, match="no plan for Linear \\('extra_head' of SandwichBlockLM\\)"):
        children_tp_plan(model, styles, skip=DECODER_CHILDREN)


def test_every_fixture_family_module_imports_where_the_package_is_imported():
    """A family's Hugging Face block sits in its folder and imports cleanly as part of it
    (from gamma_titan's copy of the shared package), as well as from a converted folder,
    next to that copy (the family matrix loads it there)."""
    import importlib
    import pkgutil

    import families

    imported = [importlib.import_module(info.name)
                for info in pkgutil.walk_packages(families.__path__, f"{families.__name__}.")]
    hf_blocks = [m for m in imported if m.__name__.rsplit(".", 1)[1].startswith("modeling_")]
    assert len(hf_blocks) == len(fixture_names())
    for module in hf_blocks:
        assert issubclass(module.__dict__[next(k for k in vars(module) if k.endswith("ForCausalLM")
                                               and k != "GammaForCausalLM")], module.GammaForCausalLM)


def test_a_parameter_no_module_claims_has_no_gamma_group():
    model = ParallelBlockLM(ParallelBlockArgs(dim=64, n_layers=1, n_heads=4, ffn_hidden_dim=96, vocab_size=64))
    rule = model.init_rule
    assert rule("layers.0.attention.gate_proj.weight", (64, 64)) == ("gate", 64)
    assert rule("layers.0.feed_forward.w2.weight", (64, 96)) == ("ffn", 96)
    assert rule("layers.0.norm.weight", (64,)) == ("norm", None)
    model.layers["0"].extra = torch.nn.Linear(64, 64, bias=False)
    with pytest.raises(KeyError, match="layers.0.extra.weight"):
        model.init_rule("layers.0.extra.weight", (64, 64))


def test_a_family_package_imported_first_registers_whole():
    """A family's package imports gamma_titan.models, whose registry holds the installed
    families: loaded at that import, the entry point would find its own package half-imported
    (AttributeError: partially initialized module). The registry loads them at its first lookup."""
    code = ("import gamma_titan, families.sandwich_block\n"
            "from gamma_titan.models import TRAIN_SPECS\n"
            "print(TRAIN_SPECS['gamma_sandwich'].model_cls.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "SandwichBlockLM", proc.stderr[-2000:]
