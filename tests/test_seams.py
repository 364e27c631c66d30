"""Where gamma-titan extends TorchTitan, it does so at TorchTitan's seams: each family exports
a bare TrainSpec that training/ wraps and registers; the validator is a subclass that sets
what TorchTitan's constructor sets; and no module of the package assigns over a TorchTitan
function or attribute at run time."""

import ast
import importlib
import inspect
import pkgutil
from importlib.metadata import entry_points

import pytest

import gamma_titan  # noqa: F401  (first: TorchTitan's device detection answers "cpu" here)
from torchtitan.components.validate import Validator
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
from torchtitan.protocols.train_spec import get_train_spec

from gamma_titan.data.loader import build_dataloader
from gamma_titan import models
from gamma_titan.models import FAMILY_ENTRY_POINTS, TRAIN_SPECS
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


def exported_models() -> dict[str, type]:
    """Where each family comes from -> its model class: every module under gamma_titan/models/
    that defines `get_train_spec` (a family's folder, or one of TorchTitan's families in
    titan/), and every installed entry point of the families' group."""
    exported = {}
    for info in pkgutil.walk_packages(models.__path__, f"{models.__name__}."):
        module = importlib.import_module(info.name)
        export = getattr(module, "get_train_spec", None)
        if callable(export) and export.__module__ == module.__name__:  # not one imported from elsewhere
            exported[info.name] = export().model_cls
    for entry in entry_points(group=FAMILY_ENTRY_POINTS):
        exported[f"entry point {entry.value}"] = entry.load()().model_cls
    return exported


def test_the_registry_holds_each_family_once_and_nothing_else():
    """A family is a folder exporting get_train_spec plus its line in TRAIN_SPECS (or an entry
    point): a folder left out of the registry, a family registered under two names or an
    entry that no folder exports is a mistake that nothing else would catch."""
    exported = exported_models()
    assert {"gamma_titan.models.dense", "gamma_titan.models.titan.llama3"} <= set(exported)  # the walk sees them
    registered = {}
    for name, spec in TRAIN_SPECS.items():
        registered.setdefault(spec.model_cls, []).append(name)
    twice = {cls.__name__: names for cls, names in registered.items() if len(names) > 1}
    assert not twice, f"one model under several names in TRAIN_SPECS: {twice}"
    unregistered = [source for source, cls in exported.items() if cls not in registered]
    assert not unregistered, f"{unregistered} export get_train_spec, but TRAIN_SPECS does not hold the family"
    stray = [names[0] for cls, names in registered.items() if cls not in exported.values()]
    assert not stray, f"TRAIN_SPECS holds {stray}, which no folder under gamma_titan/models/ nor entry point exports"


def test_families_export_torchtitans_components_and_training_registers_ours():
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


def test_a_wheel_of_the_repository_ships_every_module_and_hf_block(tmp_path):
    """pip's wheel of the working tree (as `pip install .` builds it) holds every file under
    gamma_titan/, the shared Hugging Face package and any family's HF block (its `HF_CODE`,
    a modeling_*.py in its folder) included: a family folder is a package like any other."""
    import shutil
    import subprocess
    import sys
    import zipfile

    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    source = tmp_path / "src"
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "wheel").glob("gamma_titan-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    package = {name for name in filter(None, listed) if name.startswith("gamma_titan/") and (REPO / name).is_file()}
    assert package - shipped == set()
    hf_code = {str(path.relative_to(REPO)) for spec in TRAIN_SPECS.values() if spec.state_dict_adapter
               for path in getattr(spec.state_dict_adapter, "HF_CODE", ())
               if path.is_relative_to(REPO / "gamma_titan")}
    assert hf_code <= shipped and {"gamma_titan/convert/hf_package/modeling_gamma.py"} <= shipped


@pytest.mark.parametrize("attn_type, asked", [("sdpa", False), ("flex", True), ("varlen", True)])
def test_the_validator_asks_for_attention_masks_only_where_attention_takes_them(attn_type, asked):
    """TorchTitan 0.2.2's validator asks every model (deepseek_v3 and llama3 then build a
    compiled flex block mask for an SDPA model, at every validation step; with a CUDA build of
    torch on a host without a driver the compile fails); its Trainer asks flex and varlen
    models alone, and so does ours."""
    import types

    import torch

    calls = []

    from gamma_titan.models import TRAIN_SPECS

    import dataclasses

    # TorchTitan's llama3 args, with our knobs (a copy: the registry's flavors stay as they are)
    args = dataclasses.replace(TRAIN_SPECS["llama3"].model_args["debugmodel"], attn_type=attn_type)
    assert args.takes_attention_masks() is asked
    assert TRAIN_SPECS["gamma_dense"].model_args["debug"].takes_attention_masks() is False

    class Model(torch.nn.Module):
        model_args = args

        def get_attention_masks(self, input_batch, tokenizer, extra_inputs=None):
            calls.append(input_batch.shape)
            return "masks"

    validator = GammaValidator.__new__(GammaValidator)  # what post_dataloading_process reads
    validator.parallel_dims = types.SimpleNamespace(cp_enabled=False)
    validator.tokenizer = object()
    inputs, labels = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    out_inputs, out_labels, extra_inputs, extra_kwargs = validator.post_dataloading_process(
        {"input": inputs, "positions": labels}, labels, [Model()])
    assert out_inputs is inputs and out_labels is labels and set(extra_inputs) == {"positions"}
    assert (calls == [(2, 8)]) is asked
    assert extra_kwargs == ({"attention_masks": "masks"} if asked else {})
