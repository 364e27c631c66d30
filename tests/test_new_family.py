"""A new model family is one folder and one line: tests/families/parallel_block (PaLM's
parallel block, one norm per block) is registered by one entry-point line, written here
into a temporary site folder, and nothing else in the repository knows it. Through the
project's own commands it is inspected, trained 3 steps on one process, on 2 FSDP ranks
and on 2 TP ranks (each against the one process), measured by the live diagnostics
(residual flow included) and exported to Hugging Face, where transformers gives its
logits and `from-hf` gives its tensors back bitwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, read_metrics, run_trainer

from families.parallel_block import ParallelBlockArgs, ParallelBlockLM
from families.parallel_block.model import parallel_flavors
from gamma_titan.convert.dcp_io import load_model_state
from gamma_titan.models import FAMILY_ENTRY_POINTS, TRAIN_SPECS

NAME = "gamma_parallel"
#: The one line that registers the family (a package of one's own would put it in its pyproject).
ENTRY_POINT = f"{NAME} = families.parallel_block:get_train_spec"
STEPS = 3
RUN = ("--model.name", NAME, "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "1",
       "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
       "--gamma.diagnostics.freq", str(STEPS), "--validation.freq", str(STEPS), "--validation.steps", "2",
       "--validation.local_batch_size", "4", "--checkpoint.enable", "true", "--checkpoint.interval", "1")
#: (processes, overrides): the same global batch of 8 sequences every step.
LAYOUTS = {
    "one": (1, ("--training.local_batch_size", "8")),
    "fsdp2": (2, ("--training.local_batch_size", "4")),
    "tp2": (2, ("--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                "--parallelism.data_parallel_shard_degree", "1")),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The environment of a Python that has the family installed: an entry point in a
    dist-info folder, and tests/ on the path (where the family's package is)."""
    site = tmp_path_factory.mktemp("site")
    info = site / "gamma_parallel_family-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gamma-parallel-family\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{FAMILY_ENTRY_POINTS}]\n{ENTRY_POINT}\n")
    path = os.pathsep.join(filter(None, [str(site), str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path}


def gamma_titan(env, *argv) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "gamma_titan.cli", *map(str, argv)], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def runs(env, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("parallel-runs")
    for layout, (nproc, overrides) in LAYOUTS.items():
        run_trainer(root / layout, *RUN, *overrides, nproc=nproc, env=env)
    return {layout: root / layout for layout in LAYOUTS}


def test_the_family_is_not_in_this_process_registry():
    """Only the entry point registers it: the package itself does not know it."""
    assert NAME not in TRAIN_SPECS


def test_inspect_counts_one_norm_per_block(env):
    report = json.loads(gamma_titan(env, "inspect", REPO / "configs" / "dense" / "debug.toml", "--json",
                                    "--model.name", NAME).stdout)
    args = parallel_flavors["debug"]  # the config's flavor
    norms = args.n_layers * args.dim + args.dim  # one per block, then the final norm
    assert report["model"] == "ParallelBlockLM"
    assert report["n_params"] == args.vocab_size * args.dim + norms + args.matmul_params()
    groups = {row["group"] for row in report["params"]}
    assert groups == {"embedding", "norm", "attention", "gate", "ffn", "output"}


def test_three_steps_train_and_match_one_process_on_fsdp_and_tp(runs):
    """Losses step by step, and the step-3 parameters relative to what 2 steps moved them
    (measured 1.2e-3 on FSDP 2, 9.8e-4 on TP 2: Adam's first steps magnify the rounding of
    another reduction order where a gradient is near zero; a wrong layout is off by ~1)."""
    metrics = {layout: [m for m in read_metrics(dump) if "loss" in m] for layout, dump in runs.items()}
    reference = [m["loss"] for m in metrics["one"]]
    assert len(reference) == STEPS and reference[-1] < reference[0]
    last = {layout: load_model_state(dump / "checkpoint" / f"step-{STEPS}") for layout, dump in runs.items()}
    first = load_model_state(runs["one"] / "checkpoint" / "step-1")
    moved = max((last["one"][k] - first[k]).abs().max().item() for k in first)
    for layout in ("fsdp2", "tp2"):
        losses = [m["loss"] for m in metrics[layout]]
        assert losses == pytest.approx(reference, abs=1e-5), layout
        off = max((last[layout][k] - last["one"][k]).abs().max().item() for k in first)
        print(f"{layout}: loss {max(abs(a - b) for a, b in zip(losses, reference)):.1e}, parameters {off / moved:.1e}")
        assert off <= 1e-2 * moved, (layout, off, moved)


def test_the_live_diagnostics_measure_the_parallel_block(runs):
    """The residual flow is read at the blocks, whatever they hold: present at steps 1 and
    3, and the same on 2 TP ranks (each summing its shard of the sequence) as on one."""
    rows = {layout: {m["step"]: m for m in read_metrics(dump) if "gamma/residual_flow_ratio" in m}
            for layout, dump in runs.items()}
    assert sorted(rows["one"]) == [1, STEPS]
    for step, row in rows["one"].items():
        assert 0 < row["gamma/residual_flow_ratio"] < 10
        assert {"gamma/sink_score/mean", "gamma/eps_dominated_fraction/layer_0/norm"} <= set(row)
        for layout in ("fsdp2", "tp2"):
            assert rows[layout][step]["gamma/residual_flow_ratio"] == pytest.approx(
                row["gamma/residual_flow_ratio"], rel=1e-4), (layout, step)


def test_hugging_face_export_carries_the_block_and_gives_our_logits(runs, env, tmp_path):
    transformers = pytest.importorskip("transformers")
    step = runs["one"] / "checkpoint" / f"step-{STEPS}"
    # transformers caches remote code by the folder's name: another test's "hf" folder loaded in
    # this process earlier would lend its GammaConfig class (and the model registered for it)
    hf_dir = tmp_path / "parallel_block_hf"
    gamma_titan(env, "convert", "to-hf", step, hf_dir)
    files = {p.name for p in hf_dir.iterdir()}
    assert {"modeling_gamma.py", "configuration_gamma.py", "modeling_parallel_block.py"} <= files
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["ParallelBlockForCausalLM"]

    record = json.loads((step.parent / "model.json").read_text())
    args = ParallelBlockArgs(**{k: v for k, v in record["args"].items() if k != "init"})
    ours = ParallelBlockLM(args)
    ours.load_state_dict(load_model_state(step), strict=False)  # the rotary cache is no parameter
    ours.eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                           trust_remote_code=True)
    assert type(hf).__name__ == "ParallelBlockForCausalLM"
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4

    gamma_titan(env, "convert", "from-hf", hf_dir, tmp_path / "back")
    original, back = load_model_state(step), load_model_state(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)


def test_a_block_child_without_a_tp_plan_is_refused_and_its_own_plan_is_used():
    """The TP plan is read off the block's children: norms, shared modules by type, a
    module's own `tensor_parallel_plan`; anything else with weights is refused by name."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from gamma_titan.models.common.parallelize import TPStyles, block_tp_plan

    styles = TPStyles(ColwiseParallel, RowwiseParallel, PrepareModuleInput, mesh=None)
    block = ParallelBlockLM(ParallelBlockArgs(dim=64, n_layers=1, n_heads=4, ffn_hidden_dim=96, vocab_size=64)).layers["0"]
    plan = block_tp_plan(block, styles)
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
    assert isinstance(block_tp_plan(block, styles)["extra.proj"], ColwiseParallel)
    block.extra = nn.Linear(64, 64)
    with pytest.raises(ValueError, match="no plan for Linear \\('extra' of ParallelBlock\\)"):
        block_tp_plan(block, styles)

    class ResidualNorm(nn.RMSNorm):  # a shared type with a plan of its own: its plan, not the type's
        def tensor_parallel_plan(self, styles):
            return {"": SequenceParallel(use_local_output=True)}

    block.extra = ResidualNorm(64)
    style = block_tp_plan(block, styles)["extra"]
    assert isinstance(style, SequenceParallel) and style.use_local_output


def test_a_parameter_no_module_claims_has_no_gamma_group():
    model = ParallelBlockLM(ParallelBlockArgs(dim=64, n_layers=1, n_heads=4, ffn_hidden_dim=96, vocab_size=64))
    rule = model.init_rule
    assert rule("layers.0.attention.gate_proj.weight", (64, 64)) == ("gate", 64)
    assert rule("layers.0.feed_forward.w2.weight", (64, 96)) == ("ffn", 96)
    assert rule("layers.0.norm.weight", (64,)) == ("norm", None)
    model.layers["0"].extra = torch.nn.Linear(64, 64, bias=False)
    with pytest.raises(KeyError, match="layers.0.extra.weight"):
        model.init_rule("layers.0.extra.weight", (64, 64))
