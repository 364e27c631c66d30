"""Where gamma-titan extends TorchTitan, it does so at TorchTitan's seams: each family exports
a bare TrainSpec that training/ wraps and registers; the validator is a subclass that sets
what TorchTitan's constructor sets; and no module of the package assigns over a TorchTitan
function or attribute at run time."""

import ast
import inspect

import gamma_titan  # noqa: F401  (first: TorchTitan's device detection answers "cpu" here)
from torchtitan.components.validate import Validator
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
from torchtitan.protocols.train_spec import get_train_spec

from gamma_titan.data.loader import build_dataloader
from gamma_titan.models import TRAIN_SPECS
from gamma_titan.training import train_spec  # noqa: F401  (registers the families)
from gamma_titan.training.validator import GammaValidator, build_validator
from helpers import REPO


def self_attributes(function) -> set[str]:
    """The `self.<name> = ...` targets of a function's body."""
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(function)))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_the_validator_sets_what_torchtitans_constructor_sets():
    theirs = self_attributes(Validator.__init__)
    assert {"validation_dataloader", "loss_fn", "pp_schedule"} <= theirs  # the walk sees them
    assert self_attributes(GammaValidator.__init__) | {"job_config"} == theirs | {"job_config"}
    assert list(inspect.signature(GammaValidator).parameters) == list(inspect.signature(Validator).parameters)


def test_families_export_torchtitans_components_and_training_registers_ours():
    assert set(TRAIN_SPECS) == {"gamma_dense", "gamma_moe", "llama3", "qwen3", "deepseek_v3"}
    for name, bare in TRAIN_SPECS.items():
        registered = get_train_spec(name)
        assert bare.build_dataloader_fn is build_text_dataloader, name
        assert registered.build_dataloader_fn is build_dataloader and registered.build_validator_fn is build_validator
        assert registered.model_cls is bare.model_cls and registered.model_args is bare.model_args
        assert registered.pipelining_fn is bare.pipelining_fn
        # the family's own parallelize function, wrapped to sum DDP's gradients
        assert registered.parallelize_fn.__wrapped__ is bare.parallelize_fn


def titan_assignments(source: str) -> list[int]:
    """Lines of `source` that assign to an attribute of a name bound to torchtitan (or call
    setattr on one)."""
    tree = ast.parse(source)
    titan_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchtitan"):
            titan_names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            titan_names |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                            if alias.name.startswith("torchtitan")}
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            root = target
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id in titan_names:
                lines.append(node.lineno)
        if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and node.args
                and isinstance(node.args[0], ast.Name) and node.args[0].id in titan_names):
            lines.append(node.lineno)
    return lines


def test_the_checker_sees_an_assignment_over_torchtitan():
    source = ("from torchtitan.components import validate as v\nimport torchtitan.train\n"
              "from torchtitan.models.moe.moe import MoE\nx = v.f\n"
              "v.build = f\ntorchtitan.train.main = g\nsetattr(MoE, 'forward', h)\nMoE.init.x += 1\n")
    assert titan_assignments(source) == [5, 6, 8, 7]


def test_no_module_assigns_over_torchtitan_at_run_time():
    """A reader cannot see such a change, and the next TorchTitan release breaks it silently."""
    offences = [f"{path.relative_to(REPO)}:{line}" for path in (REPO / "gamma_titan").rglob("*.py")
                for line in titan_assignments(path.read_text(encoding="utf-8"))]
    assert not offences, offences
