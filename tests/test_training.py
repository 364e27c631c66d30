"""End-to-end runs of the debug model on CPU: loss falls, logs and live diagnostics are
written, the condensation report reads the run, and the torch.compile and float8
(emulated) paths follow the eager run's losses."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import DEBUG_TOML, QUIET, REPO, read_metrics, run_trainer

pytestmark = pytest.mark.multiprocess


#: The fixture's run on top of DEBUG_RUN: 30 steps, W&B on (offline).
THIS_RUN = ("--training.steps", "30", "--metrics.enable_wandb", "true")
DEBUG_RUN = ("--metrics.log_freq", "1", "--validation.freq", "30", "--validation.steps", "4",
             "--gamma.diagnostics.freq", "10", "--checkpoint.enable", "true", "--checkpoint.interval", "10",
             "--checkpoint.keep_latest_k", "0")


@pytest.fixture(scope="module")
def debug_run_console(tmp_path_factory, builtin_assets):
    """30 steps of configs/dense/debug.toml (γ = 1, elementwise gate), diagnostics every
    10 steps, a checkpoint every 10 steps (all kept); the run folder and what it printed.
    The dump folder is given relative, as `./run`, and resolves against the directory the
    run starts in (README: *What a run writes*)."""
    dump = tmp_path_factory.mktemp("debug") / "run"
    proc = run_trainer(Path("run"), *DEBUG_RUN, *THIS_RUN, env={"WANDB_MODE": "offline"},  # W&B's file stays local
                       cwd=dump.parent)
    assert not (REPO / "run").exists()
    return dump, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def debug_run(debug_run_console):
    return debug_run_console[0]


def expected_diagnostics_tags() -> set[str]:
    """Every gamma/* tag of the debug model (4 layers, gate on), named as the issue asks."""
    import torch

    from gamma_titan.config import load_job_config
    from gamma_titan.diagnostics.live import weight_matrices
    from gamma_titan.training.train_spec import resolve_model

    spec, args = resolve_model(load_job_config(["--job.config_file", str(DEBUG_TOML)]))
    with torch.device("meta"):
        matrices = weight_matrices(spec.model_cls(args))
    tags = {"sink_score/mean", "residual_flow_ratio", "eps_dominated_fraction/final_norm", "diagnostics_seconds"}
    for i in range(args.n_layers):
        tags |= {f"sink_score/layer_{i}", f"gate_mean/layer_{i}", f"gate_sparsity/layer_{i}",
                 f"eps_dominated_fraction/layer_{i}", f"eps_dominated_fraction/layer_{i}/attention_norm",
                 f"eps_dominated_fraction/layer_{i}/ffn_norm"}
    tags |= {f"stable_rank/{name}" for name in matrices}
    return {"gamma/" + t for t in tags}


def test_debug_run_loss_falls_and_logs(debug_run):
    dump = debug_run
    records = read_metrics(dump)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 31))
    for r in train:
        assert {"step", "loss", "grad_norm", "lr", "tps"} <= set(r)
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [1, 30]  # merged into the training line of that step
    assert val[-1]["val_loss"] < val[0]["val_loss"]
    events = list((dump / "tb").rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_a_run_says_where_everything_is(debug_run_console):
    """The run folder's train.log (rank 0, no colour codes) holds every step with its
    progress and ETA; the last lines name the checkpoint, metrics and TensorBoard folders and
    the commands that resume and convert the run; metrics.jsonl has elapsed and ETA; on a
    CPU TorchTitan's peak-FLOPs lines give way to one that says what mfu means here, and
    the warnings that mean nothing here are gone."""
    debug_run, console = debug_run_console
    log = (debug_run / "train.log").read_text(encoding="utf-8")
    assert "\x1b[" not in log
    assert "step 1/30 (3%), " in log and "ETA -" in log and "step 30/30 (100%), " in log
    assert "lspci" not in log and "Peak flops undefined" not in log
    assert log.count("mfu: measured against an A100's peak FLOPs") == 1
    tail = log.splitlines()[-7:]
    assert any(f"run folder: {debug_run.resolve()}" in line for line in tail), tail
    assert any(f"last checkpoint: {debug_run.resolve() / 'checkpoint' / 'step-30'}" in line for line in tail)
    assert any("resume (or extend it with a larger --training.steps): " in line and "gamma_titan.train" in line
               for line in tail)
    assert any(f"convert to-hf {debug_run.resolve() / 'checkpoint' / 'step-30'}" in line for line in tail)
    assert any(f"tensorboard --logdir {debug_run.resolve() / 'tb'}" in line for line in tail)
    records = read_metrics(debug_run)
    assert "eta_s" not in records[0] and records[0]["elapsed_s"] >= 0
    assert records[-1]["eta_s"] == 0 and records[-1]["elapsed_s"] >= records[1]["elapsed_s"] > 0
    assert 0 < records[10]["eta_s"]
    for noise in ("lspci", "Peak flops undefined", "In CPU autocast", "set_vital"):
        assert noise not in console, noise


def test_the_readme_says_what_a_run_writes(debug_run):
    """README's *What a run writes*: each path of its tree is in the run folder (W&B's
    offline run included), the folder holds nothing the tree leaves out, and every
    metrics.jsonl key it names is in the file (those of MoE and the step guard excepted)."""
    import re

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## What a run writes\n", 1)[1].split("\n## ", 1)[0]
    tree = section.split("```", 2)[1].splitlines()
    listed = [line.split()[0] for line in tree if line.startswith("  ") and not line.startswith("   ")]
    assert tree[1] == "outputs/debug/" and len(listed) >= 6
    for path in listed:
        pattern = re.sub(r"<[^>]+>", "*", path).replace("step-N", "step-*").rstrip("/")
        assert list(debug_run.glob(pattern)), path
    assert list(debug_run.glob("tb/*/wandb"))  # "with W&B offline, its run in wandb/"
    assert {p.name for p in debug_run.iterdir()} == {path.split("/")[0] for path in listed}

    paragraph = section.split("**metrics.jsonl.**", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`([a-z_/*]+)`", paragraph)) - {"moe/*", "nonfinite_skipped", "loss_spike"}
    keys = set().union(*read_metrics(debug_run))
    assert {"val_loss", "eta_s", "gamma/*", "time_metrics/*"} <= named
    for name in named:
        assert (any(k.startswith(name[:-1]) for k in keys) if name.endswith("*") else name in keys), name


def test_wandb_logs_every_scalar_tensorboard_gets(debug_run):
    """metrics.enable_wandb (offline here): W&B's run file holds every scalar tag the
    TensorBoard events hold, the gamma/* diagnostics included."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = {p.parent for p in (debug_run / "tb").rglob("events.out.tfevents.*")}
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert "gamma/residual_flow_ratio" in tags and "loss_metrics/global_avg_loss" in tags
    [run_file] = (debug_run / "tb").rglob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()  # the history records keep each key as plain UTF-8
    assert [t for t in tags if t.encode() not in data] == []


def test_logged_tflops_use_the_models_flops_per_token(debug_run):
    """tflops = FLOPs/token · tokens/s, with FLOPs/token the count that tests/test_flops.py
    checks against the matmuls a training step executes (elementwise gate, GQA)."""
    from gamma_titan.config import load_job_config
    from gamma_titan.training.train_spec import resolve_model

    config = load_job_config(["--job.config_file", str(DEBUG_TOML)])
    _, args = resolve_model(config)
    flops = args.flops_per_token(config.training.seq_len)
    train = [r for r in read_metrics(debug_run) if "tps" in r]
    assert train
    for r in train:
        assert r["tflops"] == pytest.approx(flops * r["tps"] / 1e12, rel=1e-6)


def test_run_folder_records_the_resolved_config_versions_and_command(debug_run):
    from gamma_titan.config import load_job_config

    records = sorted((debug_run / "runs").iterdir())
    assert len(records) == 1
    info = json.loads((records[0] / "run.json").read_text())
    command = info["command"]
    assert command[command.index("-m") + 1] == "gamma_titan.train" and "--training.steps" in command
    assert info["world_size"] == 1 and info["packages"]["torchtitan"].startswith("0.2")
    assert info["git"] is None or len(info["git"]["commit"]) == 40
    reloaded = load_job_config(["--job.config_file", str(records[0] / "config.toml")])
    assert info["cwd"] == str(debug_run.parent)  # what the relative dump folder ("run") is relative to
    original = load_job_config(["--job.config_file", str(DEBUG_TOML), "--job.dump_folder", "run",
                                *DEBUG_RUN, *THIS_RUN])
    loaded, expected = reloaded.to_dict(), original.to_dict()
    assert loaded["job"].pop("config_file") == str(records[0] / "config.toml")
    assert expected["job"].pop("config_file") == str(DEBUG_TOML)
    assert loaded == expected
    assert reloaded.training.steps == 30 and reloaded.gamma.diagnostics.freq == 10


def test_diagnostics_are_logged_at_the_configured_steps_with_their_tags(debug_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = expected_diagnostics_tags()
    records = read_metrics(debug_run)
    measured = [r for r in records if any(k.startswith("gamma/") for k in r)]
    assert [r["step"] for r in measured] == [1, 10, 20, 30]
    for r in measured:
        assert {k for k in r if k.startswith("gamma/")} == expected
        assert 0 < r["gamma/sink_score/mean"] < 1 and r["gamma/residual_flow_ratio"] > 0
        assert all(r[t] >= 1 for t in expected if "stable_rank" in t)
    # at init (step 1, one small step from γ = 1) the attention is near uniform: the mean
    # of 1/(i+1) over queries i = 1..255 is 0.0201
    assert measured[0]["gamma/sink_score/mean"] == pytest.approx(0.0201, abs=0.002)

    events = EventAccumulator(str(next((debug_run / "tb").rglob("events.out.tfevents.*"))),
                              size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert expected <= scalars
    assert [e.step for e in events.Scalars("gamma/sink_score/layer_2")] == [1, 10, 20, 30]
    images = events.Tags()["images"]
    assert set(images) == {f"gamma/cosine/layers.{i}.{m}.weight" for i in (0, 3)
                           for m in ("attention.wo", "feed_forward.w1")}
    assert [e.step for e in events.Images(images[0])] == [1]  # every 10 x freq steps, and step 1


def test_condensation_report_from_the_runs_checkpoints(debug_run, tmp_path):
    out = tmp_path / "report"
    report = [sys.executable, "-m", "gamma_titan.cli", "report", "condensation", str(debug_run), "--out", str(out)]
    bad = subprocess.run([*report, "--steps", "15"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--steps 15" in bad.stderr and not out.exists()
    proc = subprocess.run([*report, "--steps", "10", "30"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "condensation.md", "cosine_layers_0_attention_wo.png", "cosine_layers_0_feed_forward_w1.png",
        "sink_score.png", "stable_rank.png"]
    assert all((out / f).read_bytes()[:4] == b"\x89PNG" for f in ("stable_rank.png", "sink_score.png"))
    summary = (out / "condensation.md").read_text()
    assert "| feed_forward.w1 |" in summary and "step 10 | step 20 | step 30" in summary
    # the report's stable ranks are the live ones at the same steps (same weights, same method)
    live = {r["step"]: r for r in read_metrics(debug_run)}
    row = next(l for l in summary.splitlines() if l.startswith("| feed_forward.w1 |"))
    reported = [float(c) for c in row.split("|")[2:5]]
    for step, value in zip((10, 20, 30), reported):
        mean = sum(live[step][f"gamma/stable_rank/layers.{i}.feed_forward.w1.weight"] for i in range(4)) / 4
        assert value == pytest.approx(mean, abs=0.006)


def test_resume_trains_on_the_same_batches_and_appends_metrics(debug_run, tmp_path):
    """A run resumed from debug_run's step-20 checkpoint (model, optimizer, schedule, the
    data loader's position and the diagnostics' warm state) reproduces its losses and its
    step-30 diagnostics bitwise, and appends to metrics.jsonl."""
    dump = tmp_path / "run"
    shutil.copytree(debug_run / "checkpoint" / "step-20", dump / "checkpoint" / "step-20")
    (dump / "metrics.jsonl").write_text(json.dumps({"step": 0, "note": "earlier run"}) + "\n")
    run_trainer(dump, *DEBUG_RUN, "--training.steps", "30", "--metrics.enable_tensorboard", "false",
                "--validation.enable", "false")
    records = read_metrics(dump)
    assert records[0] == {"step": 0, "note": "earlier run"}
    assert [r["step"] for r in records[1:]] == list(range(21, 31))
    original = {r["step"]: r for r in read_metrics(debug_run)}
    assert [r["loss"] for r in records[1:]] == [original[s]["loss"] for s in range(21, 31)]
    resumed_diagnostics = {k: v for k, v in records[-1].items() if k.startswith("gamma/") and "seconds" not in k}
    assert len(resumed_diagnostics) > 20
    assert resumed_diagnostics == {k: original[30][k] for k in resumed_diagnostics}


#: compile and float8 (emulated) against the eager debug_run, steps 1-3: the same config,
#: seed and data, and the same learning rates (the 3-step runs keep the 30-step schedule,
#: --lr_scheduler.total_steps 30); the rest of DEBUG_RUN (validation, diagnostics,
#: checkpoints) leaves the training numbers alone: an eager 3-step run reproduces
#: debug_run's losses bitwise. Measured largest relative differences: compile 2.3e-7 (fp32
#: rounding of fused kernels), float8 8.9e-5 (2.3e-6, 2.8e-5, 8.9e-5 by step); the bounds
#: leave a margin of 40 and 5.6.
VARIANT_RTOL = {"compile": 1e-5, "float8": 5e-4}


@pytest.mark.parametrize("variant", ["compile", "float8"])
def test_compile_and_float8_run_three_steps(tmp_path, variant, debug_run):
    extra = {
        "compile": ("--compile.enable", "true"),
        "float8": ("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate", "true",
                   "--quantize.linear.float8.filter_fqns", "output"),
    }[variant]
    dump = tmp_path / variant
    proc = run_trainer(dump, "--training.steps", "3", "--lr_scheduler.total_steps", "30", "--metrics.log_freq", "1",
                       "--validation.enable", "false", "--metrics.enable_tensorboard", "false", *extra)
    records = read_metrics(dump)
    losses = [r["loss"] for r in records]
    eager = [r["loss"] for r in read_metrics(debug_run)[:3]]
    assert len(losses) == 3
    assert losses == pytest.approx(eager, rel=VARIANT_RTOL[variant])
    if variant == "float8":
        assert losses != eager  # the float8 casts did change the numbers
    assert records[0]["gamma/sink_score/mean"] > 0  # diagnostics (on in debug.toml) ran on this path
    log = proc.stdout + proc.stderr
    assert ("Compiling each TransformerBlock" in log) if variant == "compile" else ("Swapped to Float8Linear" in log)


def test_trained_checkpoint_converts_to_hf_with_the_same_logits(debug_run, tmp_path):
    """model.json next to the checkpoints rebuilds the run's model args, and the trained
    (elementwise-gated) checkpoint gives our logits in transformers."""
    import torch
    transformers = pytest.importorskip("transformers")

    from gamma_titan.config import load_job_config
    from gamma_titan.convert.dcp_io import load_model_state
    from gamma_titan.convert.hf import to_hf
    from gamma_titan.convert.model_record import read_model_record
    from gamma_titan.training.train_spec import resolve_model

    step = debug_run / "checkpoint" / "step-30"
    name, args, record = read_model_record(step)
    spec, expected = resolve_model(load_job_config(["--job.config_file", str(DEBUG_TOML)]))
    assert name == "gamma_dense" and record["flavor"] == "debug"
    assert args == expected and args.attention_gate == "elementwise" and args.norm_eps == 1e-12

    model = spec.model_cls(args)
    model.load_state_dict(load_model_state(step))
    hf = transformers.AutoModelForCausalLM.from_pretrained(to_hf(step, tmp_path / "hf", progress=False),
                                                           dtype=torch.float32, trust_remote_code=True)
    tokens = torch.randint(0, args.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4

    # Back to DCP, and training starts from it: step 1's loss is the converted model's loss on
    # the first batch.
    from gamma_titan.cli import main as cli_main
    from gamma_titan.data.rank_batches import PackedSequences
    from gamma_titan.data.shard_sources import open_samples

    with pytest.raises(SystemExit) as done:
        cli_main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "start")])
    assert done.value.code == 0
    run_trainer(tmp_path / "run", *QUIET, "--training.steps", "1", "--checkpoint.enable", "true",
                "--checkpoint.initial_load_path", str(tmp_path / "start"), "--checkpoint.interval", "100")
    config = load_job_config(["--job.config_file", str(DEBUG_TOML)])
    inputs, labels = next(iter(PackedSequences(open_samples(config, "training", config.training.seq_len), 0, 1,
                                               config.training.local_batch_size)))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(inputs["input"]).flatten(0, 1), labels.flatten())
    assert read_metrics(tmp_path / "run")[0]["loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_the_run_says_what_it_reads_and_the_knobs_it_resolved(debug_run_console):
    """run.json's `reads` and the start lines: the built-in source's tokens (its meta.json),
    the epochs 30 steps take of it, the validation source, the tokenizer; TorchTitan's
    "Starting job" line carries the resolved knobs."""
    from gamma_titan.config import load_job_config
    from gamma_titan.data.builtin_shards import ensure_builtin_shards
    from gamma_titan.data.tokenizer import ensure_builtin_tokenizer
    from gamma_titan.training.preflight import global_batch_size

    dump, console = debug_run_console
    reads = json.loads(next((dump / "runs").glob("*/run.json")).read_text())["reads"]
    meta = json.loads((ensure_builtin_shards(ensure_builtin_tokenizer(4096)) / "meta.json").read_text())
    config = load_job_config(["--job.config_file", str(DEBUG_TOML), *DEBUG_RUN, *THIS_RUN])
    train_tokens = meta["splits"]["train"]["tokens"]
    sequences = (train_tokens - 1) // config.training.seq_len
    [train] = reads["training"]
    assert train["tokens"] == train_tokens and train["weight"] == 1.0
    assert train["epochs"] == pytest.approx(30 * global_batch_size(config.training, 1) / sequences, rel=1e-12)
    [validation] = reads["validation"]
    assert validation["tokens"] == meta["splits"]["validation"]["tokens"] and validation["epochs"] is None
    assert reads["tokenizer"]["vocab_size"] == 4096 == reads["tokenizer"]["model_vocab_size"]
    assert f"reads: training data 'builtin' (train split): weight 1, {train_tokens:,} tokens, " in console
    # the validation set: validation.steps x local_batch_size sequences in all, at any layout
    v = config.validation
    held = min(v.steps * v.local_batch_size, (validation["tokens"] - 1) // v.seq_len)
    assert reads["validation_set"] == {"sequences": held, "tokens": held * v.seq_len, "capped": False,
                                       "requested": v.steps * v.local_batch_size,
                                       "per_source": {"builtin": held}}
    assert (f"reads: validation set: {held} sequences ({held * v.seq_len:,} tokens), the same at any layout and "
            f"after any resume (validation.steps x validation.local_batch_size = {held})") in console
    assert "Starting job: gamma_dense debug: γ = 1, ε = 1e-12, attention gate = elementwise (config: " in console
