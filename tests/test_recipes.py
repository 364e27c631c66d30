"""Recipes: every recipe's plan at both scales, the SLURM scripts, bad input, and the
scaling-law fit against known laws. (Training runs: test_recipe_runs.py.)"""

import json
import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO, readme_commands
from gamma_titan.errors import ConfigError
from gamma_titan.training.launch import SHUTDOWN_MARGIN_SECONDS, save_seconds
from gamma_titan.recipes.plan import plan
from gamma_titan.recipes.run import execute, plan_recipe, run_recipe
from gamma_titan.recipes.spec import available, load_recipe
from gamma_titan.reports.scaling import PowerLaw, effective_size_gain, fit_power_law

GAMMAS = [0.5, 0.75, 1.0, 1.25, 1.5]
#: recipe -> ({scale: settings (cells)}, {cell name at the paper scale: overrides it must carry})
EXPECTED = {
    "gamma_sweep": ({"tiny": 15, "gpu": 10, "paper": 5},
                    {"g1": {"gamma.init_rate": 1.0, "gamma.norm_eps": 1e-12, "gamma.attention_gate": "elementwise"}}),
    "eps_ablation": ({"tiny": 4, "gpu": 4, "paper": 4},
                     {"g1_eps1e-05": {"gamma.init_rate": 1.0, "gamma.norm_eps": 1e-5, "gamma.attention_gate": "none"},
                      "g0.5_eps1e-12": {"gamma.init_rate": 0.5, "gamma.norm_eps": 1e-12}}),
    "gate_ablation": ({"tiny": 4, "gpu": 4, "paper": 4},
                      {"g1_gatenone": {"gamma.attention_gate": "none", "gamma.norm_eps": 1e-12},
                       "g1_gateelementwise": {"gamma.attention_gate": "elementwise", "gamma.init_rate": 1.0}}),
    "lr_check": ({"tiny": 10, "gpu": 10, "paper": 10},
                 {"small_lr0.01": {"optimizer.lr": 0.01, "gamma.init_rate": 1.0, "gamma.norm_eps": 1e-12},
                  "standard_lr0.1": {"optimizer.lr": 0.1, "gamma.init_rate": 0.5, "gamma.attention_gate": "none"}}),
    "scaling": ({"tiny": 8, "gpu": 6, "paper": 8}, {}),
    "weight_decay": ({"tiny": 2, "gpu": 2, "paper": 2},
                     {"weight_decay_policyall": {"optimizer.weight_decay_policy": "all", "gamma.init_rate": 1.0},
                      "weight_decay_policymegatron": {"optimizer.weight_decay_policy": "megatron"}}),
    "moe": ({"tiny": 8, "gpu": 8, "paper": 8}, {}),
}
SEEDS = {"tiny": 3, "gpu": 2, "paper": 1}
PAPER_TOKENS = {"gamma_sweep": 36e9, "eps_ablation": 36e9, "gate_ablation": 36e9, "lr_check": 36e9, "scaling": 36e9,
                "moe": 100e9, "weight_decay": 36e9}
#: The gpu and paper scales train far more tokens than the built-in corpus holds (their
#: configs' placeholder data): their plans here lift the epoch guard (a real run is given
#: its data with --training.dataset_path).
LIFT_EPOCHS = 1e9


#: Recipes with a [tune] search: planned round by round (tests/test_ladder.py).
TUNED = ["lr_ladder"]


def test_every_recipe_is_covered():
    assert sorted([*EXPECTED, *TUNED]) == available()
    assert [name for name in available() if load_recipe(name).tunes] == TUNED


@pytest.mark.parametrize("scale", ["tiny", "gpu", "paper"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dry_run_lists_the_runs(name, scale, builtin_assets, tmp_path, capsys):
    out = tmp_path / "out"
    allow = None if scale == "tiny" else LIFT_EPOCHS
    planned = plan_recipe(name, scale, out=str(out), allow_epochs=allow)  # what run_recipe plans, once
    assert execute(planned, launcher="slurm" if scale == "paper" else "local", dry_run=True) == 0
    printed = capsys.readouterr().out
    runs = planned.runs
    cells, must = EXPECTED[name]
    assert len({r.cell for r in runs}) == cells[scale] and len(runs) == cells[scale] * SEEDS[scale]
    assert len({r.name for r in runs}) == len(runs)
    for cell in {r.cell for r in runs}:  # every cell once per seed, the seed setting init and data order
        seeds = sorted(r.seed for r in runs if r.cell == cell) if SEEDS[scale] > 1 else [None]
        assert seeds == (list(range(SEEDS[scale])) if SEEDS[scale] > 1 else [None])
        for r in runs:
            if r.cell == cell and r.seed is not None:
                assert r.name == f"{cell}_s{r.seed}"
                assert r.overrides["debug.seed"] == r.overrides["gamma.data.seed"] == r.seed
    by_cell = {r.cell: r for r in runs}
    if scale == "paper":
        for cell, overrides in must.items():
            for key, value in overrides.items():
                assert by_cell[cell].overrides[key] == value, (cell, key)
    for r in runs:
        assert f"  {r.name}: " in printed and f"--training.steps {r.steps}" in printed
        assert f"ε / σ²(h) at init = {r.norm_eps:g} / {r.hidden_var:.3g} = {r.eps_ratio:.3g}" in printed
    if name == "gamma_sweep":
        for label in {r.model_label for r in runs}:
            assert sorted({r.overrides["gamma.init_rate"] for r in runs if r.model_label == label}) == GAMMAS
    if name == "scaling":  # sizes x two arms, and the arms are what the paper compares
        assert len({r.model_label for r in runs}) == cells[scale] // 2
        standard = [r for r in runs if r.arm == "standard"]
        assert all(r.overrides["gamma.init_rate"] == 0.5 and r.overrides["gamma.attention_gate"] == "none"
                   for r in standard) and len(standard) == len(runs) // 2
    if name == "moe":
        assert {r.arm for r in runs} == {"standard", "adjusted"}
        assert {r.overrides["gamma.init_rate"] for r in runs} == {0.5, 1.0}
    if name == "eps_ablation":  # ε = 1e-5 dominates σ²(h) = d^-2 at γ = 1, and nowhere else
        assert all(r.eps_dominated == (r.values["gamma.init_rate"] == 1.0 and r.norm_eps == 1e-5) for r in runs)
        assert "WARNING" not in printed
    for label in {r.model_label for r in runs}:  # one model: one step count, whatever the arm adds
        assert len({r.steps for r in runs if r.model_label == label}) == 1
    if scale == "tiny":
        assert all(r.tokens_per_param >= 20 and r.world_size == 1 for r in runs)
        assert all(r.epochs <= 1 for r in runs)  # single-epoch data
        assert f"{runs[0].epochs:.3g} epochs of training.dataset" in printed
        assert not out.exists()  # a local dry run writes nothing
    elif scale == "gpu":
        assert all(r.world_size == 1 and r.overrides["training.mixed_precision_param"] == "bfloat16"
                   if "training.mixed_precision_param" in r.overrides else r.world_size == 1 for r in runs)
        assert all(r.model_label.startswith("gpu") for r in runs)
        assert all(r.tokens_per_param >= 20 for r in runs if r.active_params is None)  # dense: >= 20 tokens/param
        assert all(r.hidden_var <= 256 ** -2 * 1.05 or r.values.get("gamma.init_rate", 1) < 1 for r in runs)
        hours = sum(r.gpu_hours for r in runs)
        assert 0.2 <= hours <= 1.6 and f"total ≈ {hours:.4g} GPU-hours (at 30% MFU" in printed
        assert not out.exists()
    else:
        assert all(r.tokens >= PAPER_TOKENS[name] and r.tokens < PAPER_TOKENS[name] * 1.03 for r in runs)
        assert all(r.world_size % 8 == 0 and r.gpu_hours > 1 for r in runs)
        scripts = sorted((out / "slurm").glob("*.sbatch"))
        assert sorted(p.stem for p in scripts) == sorted(r.name for r in runs)
        for path in scripts:
            check_sbatch_script(path, next(r for r in runs if r.name == path.stem), out)
        assert sorted(p.name for p in out.iterdir()) == ["recipe.json", "slurm"]  # no empty run folder


def test_the_epoch_guard_refuses_a_second_pass_unless_the_recipe_allows_it(builtin_assets, tmp_path):
    """A run's tokens against one epoch of its training data: the gpu scale's budget on the
    built-in corpus is refused in one line, and so is a tiny run the docs alone cannot feed."""
    with pytest.raises(ConfigError) as err:
        plan(load_recipe("gate_ablation"), "gpu")
    message = str(err.value)
    assert re.match(r"recipe gate_ablation, run g0\.5_gatenone_s0: [\d.e+]+ epochs of training.dataset \(655\.4M of "
                    r"[\d.]+M tokens\), more than the 1 \[scale.gpu\] allow_epochs permits", message), message
    runs = plan(load_recipe("gate_ablation"), "gpu", allow_epochs=LIFT_EPOCHS)
    assert all(r.epochs > 1000 for r in runs)
    config = tmp_path / "docs_only.toml"  # tiny-64's 3.7M tokens on the docs alone (1.0M): 3.7 epochs
    tiny = (REPO / "configs/dense/tiny.toml").read_text()
    config.write_text(re.sub(r"\[gamma\.data\]\n(#.*\n)*mixture = .*\n", "", tiny))
    assert "mixture =" not in config.read_text()
    recipe = tmp_path / "docs_recipe.toml"
    recipe.write_text(f'[recipe]\ntitle = "docs"\n[grid]\n"gamma.init_rate" = [1.0]\n[scale.tiny]\n'
                      f'tokens_per_param = 20\nmodels = [{{ config = "{config}", flavor = "tiny-64" }}]\n')
    with pytest.raises(ConfigError, match=r"run g1_s0: 3\.69 epochs of training.dataset \(3\.686M of 0\.9994M"):
        plan(load_recipe(str(recipe)), "tiny")
    recipe.write_text(recipe.read_text().replace("[scale.tiny]\n", "[scale.tiny]\nallow_epochs = 4\n"))
    assert [round(r.epochs, 2) for r in plan(load_recipe(str(recipe)), "tiny")] == [3.69] * 3


def test_an_eps_ablation_where_eps_never_dominates_is_warned_about(builtin_assets, tmp_path, capsys):
    """σ²(h) at init, measured: at a pre-norm model's first norm, the embedding's d^-2γ: at
    width 64 and γ = 1 it is 2.4e-4, 24x above ε = 1e-5. (A post-norm model:
    test_norm_variance.py.)"""
    recipe = tmp_path / "narrow_eps.toml"
    recipe.write_text('[recipe]\ntitle = "narrow"\n[grid]\n"gamma.norm_eps" = [1e-5, 1e-12]\n[scale.tiny]\n'
                      'tokens_per_param = 20\nseeds = [0]\n'
                      'models = [{ config = "configs/dense/tiny.toml", flavor = "tiny-64" }]\n')
    planned = plan_recipe(str(recipe), "tiny", out=str(tmp_path / "out"))
    assert execute(planned, dry_run=True) == 0
    printed = capsys.readouterr().out
    runs = planned.runs
    assert [r.hidden_var_site for r in runs] == ["layers.*.attention_norm"] * 2
    assert [r.hidden_var for r in runs] == [pytest.approx(64.0 ** -2, rel=0.05)] * 2
    assert not any(r.eps_dominated for r in runs)
    assert ("ε / σ²(h) at init = 1e-05 / 0.000241 = 0.0414 (ε negligible: <= 0.1; σ²(h) at "
            "layers.*.attention_norm, the smallest norm input)") in printed
    assert ("WARNING: this recipe varies ε, but ε ≤ 0.1·σ²(h) in every run (largest ε/σ²(h): 0.0414, run "
            "eps1e-05_s0, at layers.*.attention_norm)") in printed
    recipe.write_text(recipe.read_text().replace('flavor = "tiny-64"', 'flavor = "tiny-128"'))
    assert run_recipe(str(recipe), "tiny", dry_run=True, out=str(tmp_path / "out")) == 0
    printed = capsys.readouterr().out
    assert re.search(r" / 6\.\d+e-05 = 0\.16\d \(ε-DOMINATED; σ²\(h\) at layers\.\*\.attention_norm", printed)
    assert "WARNING" not in printed


def check_sbatch_script(path: Path, run, out: Path) -> None:
    from gamma_titan.recipes.slurm import time_limit_minutes
    from gamma_titan.recipes.spec import load_recipe
    from gamma_titan.training.launch import TORCHRUN

    text = path.read_text()
    subprocess.run(["bash", "-n", str(path)], check=True)
    assert f"#SBATCH --nodes={run.nodes}\n" in text and f"#SBATCH --gpus-per-node={run.gpus_per_node}\n" in text
    assert "#SBATCH --ntasks-per-node=1\n" in text and "#SBATCH --requeue\n" in text
    assert 'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))' in text  # head node from the node list
    # the rendezvous: a free port found on the head node, an id of its own per start and attempt
    assert 'helper rendezvous "$(node_addr "$head")" "$other"' in text and 'head="$SLURMD_NODENAME"' in text
    assert 'export GAMMA_TITAN_RDZV_HOST="$SLURMD_NODENAME"' in text  # the head hosts the store, or fails
    assert '--rdzv_endpoint="$rdzv_addr:$rdzv_port"' in text and '--rdzv_id="$rdzv_id"' in text
    assert '--nnodes="$SLURM_JOB_NUM_NODES"' in text
    assert f"--nproc_per_node={run.gpus_per_node}" in text and f"-m {TORCHRUN} " in text
    assert f"--job.dump_folder {(out / run.name).resolve()}" in text
    assert f"--training.steps {run.steps}" in text and "-m gamma_titan.train" in text
    # the log goes where the script is (that folder exists when the script does: submitted by
    # hand, it starts); the resume hint names the kept script, not SLURM's spool copy
    assert f"#SBATCH --output={(out / 'slurm').resolve()}/{run.name}-%j.out\n" in text
    assert f"export GAMMA_TITAN_LAUNCH_COMMAND='sbatch {path.resolve()}'" in text
    # srun in a session of its own (scancel --full signals the script's process group, and srun
    # kills its tasks on a SIGTERM of its own); the script forwards SIGTERM to the job's steps
    assert "setsid srun --kill-on-bad-exit=1 --label" in text
    # CPU threads: the node's CPUs over its ranks, unless the user set them
    assert f"threads=$(( ${{SLURM_CPUS_PER_TASK:-${{SLURM_CPUS_ON_NODE:-1}}}} / {run.gpus_per_node} ))" in text
    assert 'export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}' in text
    assert "trap 'forward USR1' USR1\n" in text and 'scancel --signal=TERM "$SLURM_JOB_ID"' in text
    # The stop (hazard 3): the grace period covers the step and an estimated full save; torchrun
    # waits for it before SIGKILL; the job signals itself that much before its end time, which it
    # reads from SLURM at every start (no --signal: a --time given to sbatch by hand is followed)
    grace = run.stop_grace_seconds
    assert grace >= 1.5 * save_seconds(run.params, run.nodes) and grace >= 300
    assert "#SBATCH --signal" not in text and f'helper start "$RUN_DIR" {grace:g}' in text
    assert f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={math.ceil(grace) + SHUTDOWN_MARGIN_SECONDS}\n" in text
    assert "--shutdown-timeout" not in text  # decided by the torch the job runs, not the one that wrote it
    minutes = time_limit_minutes(run, load_recipe(json.loads((out / "recipe.json").read_text())["recipe_file"]).scale("paper"))
    assert f"#SBATCH --time={minutes // 1440}-{minutes % 1440 // 60:02d}:{minutes % 60:02d}:00\n" in text


def test_the_plan_keeps_what_the_user_set_and_says_what_it_chose(builtin_assets, tmp_path, capsys):
    """A user's config (debug.toml's validation every 50, diagnostics every 100) wrapped in a
    one-run recipe whose [set] asks for a checkpoint every 20: the plan keeps all three and
    sets only the steps; a frequency the steps do not divide is refused in one line; the
    step rounding is said. (Before: checkpoint.interval became the run's length and both
    frequencies a quarter of it, silently.)"""
    config = tmp_path / "mine.toml"
    config.write_text((REPO / "configs/dense/debug.toml").read_text())
    recipe = tmp_path / "mine_recipe.toml"
    recipe.write_text(f'[recipe]\ntitle = "mine"\n[set]\n"checkpoint.interval" = 20\n[grid]\n"gamma.init_rate" = [1.0]\n'
                      f'[scale.tiny]\ntokens = 600_000\nseeds = [0]\nallow_epochs = 3\nmodels = [{{ config = "{config}" }}]\n')
    (run,) = plan(load_recipe(str(recipe)), "tiny")
    assert run.steps == 300 and run.budget_steps == 293  # 600k tokens / (8 x 256) = 292.97, up to 300
    assert run.overrides["checkpoint.interval"] == 20
    assert "validation.freq" not in run.overrides and "gamma.diagnostics.freq" not in run.overrides
    assert run.plan_set == ["training.steps"]
    assert execute(plan_recipe(str(recipe), "tiny", out=str(tmp_path / "out")), dry_run=True) == 0
    printed = capsys.readouterr().out
    assert "steps 300 x 8 seq x 256 (the budget needs 293: rounded up to a multiple of 100)" in printed
    assert "set by the plan (nobody else set them): training.steps = 300\n" in printed
    # the config's own validation every 50 cannot land on the last of 280 steps
    recipe.write_text(recipe.read_text().replace("tokens = 600_000", "tokens = 550_000\nstep_multiple = 20"))
    with pytest.raises(ConfigError, match=r"^run g1_s0: validation.freq = 50 does not divide its 280 steps: the report "
                                          r"compares every run at its last step"):
        plan(load_recipe(str(recipe)), "tiny")
    # what nobody set, the plan chooses, and says so
    config.write_text(re.sub(r"\nfreq = \d+[^\n]*\n", "\n", config.read_text()))
    (run,) = plan(load_recipe(str(recipe)), "tiny")
    assert run.plan_set == ["training.steps", "validation.freq", "gamma.diagnostics.freq"]
    assert run.overrides["validation.freq"] == run.overrides["gamma.diagnostics.freq"] == 280 // 4


def test_stop_grace_covers_the_save_of_a_big_model():
    from gamma_titan.training.launch import shutdown_timeout, stop_grace_seconds

    assert save_seconds(16_000_000_000, nodes=1) == 5 + 192.0  # 12 bytes per parameter at 1 GB/s, + 5 s
    assert stop_grace_seconds(300, 16_000_000_000, nodes=1, step_seconds=20) == 326  # 1.5 x (20 + 197)
    assert stop_grace_seconds(300, 1_000_000_000, nodes=4, step_seconds=2) == 300  # the configured one
    assert shutdown_timeout(326) == 326 + SHUTDOWN_MARGIN_SECONDS


def test_a_torchrun_without_shutdown_timeout_gets_no_flag_and_a_warning(monkeypatch):
    """torch 2.11's torchrun has no --shutdown-timeout (it SIGKILLs 30 s after SIGTERM):
    the launches leave the flag out and say what it costs; torch 2.13's has it."""
    from gamma_titan.training import launch

    assert launch.torchrun_takes_shutdown_timeout()  # this machine's torch 2.13
    assert "--shutdown-timeout=360" in launch.torchrun_command(1, ["x"], 300)[0]
    assert launch.shutdown_warning(300) is None
    monkeypatch.setattr(launch, "torchrun_takes_shutdown_timeout", lambda: False)
    command, _ = launch.torchrun_command(1, ["x"], 300)
    assert not any(a.startswith("--shutdown-timeout") for a in command)
    assert "SIGKILLs the workers 30 s after forwarding SIGTERM" in launch.shutdown_warning(300)
    assert "stop_grace_seconds = 300" in launch.shutdown_warning(300) and launch.shutdown_warning(20) is None


def test_a_launched_trainer_is_a_world_of_its_own(monkeypatch):
    """A trainer launched from inside another launch (a recipe run from a torchrun worker, or
    a test process where a world of one trained in-process) leaves that world's variables
    behind: with them, a world of one would take the inherited MASTER_PORT, and two runs of
    a recipe at once would share it (the second failing to bind). Everything else passes."""
    from gamma_titan.training import launch

    outer = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "33747",
             "TORCHELASTIC_USE_AGENT_STORE": "True", "A_USER_VARIABLE": "kept"}
    for key, value in outer.items():
        monkeypatch.setenv(key, value)
    for command, env in (launch.train_command(1, ["x"], 300), launch.torchrun_command(2, ["x"], 300)):
        assert not set(launch.WORLD_VARIABLES) & set(env), command
        assert env["A_USER_VARIABLE"] == "kept" and env["PATH"] == os.environ["PATH"]


def test_slurm_without_sbatch_fails_before_writing(builtin_assets, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="no sbatch on PATH"):
        run_recipe("gamma_sweep", "paper", launcher="slurm", out=str(out), allow_epochs=LIFT_EPOCHS)
    assert not out.exists()


def test_the_readmes_dry_run_commands_run(builtin_assets, tmp_path, capsys, monkeypatch):
    """Every `gamma-titan recipe run ... --dry-run` line of the README, as written (with an
    --out of its own), plans and exits 0; with SLURM it writes the scripts, locally nothing. The --out is relative: it resolves against the
    current directory, and the sbatch scripts name the runs' folders by absolute path (a
    SLURM job starts elsewhere)."""
    from gamma_titan.cli import main
    from gamma_titan.files import RECIPE_PLAN_FILE

    monkeypatch.chdir(tmp_path)

    lines = [argv for argv in readme_commands((REPO / "README.md").read_text(encoding="utf-8"))
             if argv[:3] == ["gamma-titan", "recipe", "run"] and "--dry-run" in argv]  # the synopsis has [--dry-run]
    assert lines
    for i, argv in enumerate(lines):
        with pytest.raises(SystemExit) as exit_:
            main([*argv[1:], "--out", f"out-{i}"])
        assert exit_.value.code == 0, (argv, capsys.readouterr().err)
        if "slurm" not in argv:  # a local dry run prints the plan and writes nothing
            assert not (tmp_path / f"out-{i}").exists(), argv
            continue
        assert (tmp_path / f"out-{i}" / RECIPE_PLAN_FILE).is_file()
        scripts = list((tmp_path / f"out-{i}" / "slurm").glob("*.sbatch"))
        assert scripts
        for script in scripts:
            assert f"--job.dump_folder {tmp_path / f'out-{i}' / script.stem}" in script.read_text(), script


def test_bad_input_is_one_line_before_anything_is_written(builtin_assets, tmp_path, capsys):
    from gamma_titan.cli import main

    cases = [  # (recipe, message, arguments)
        ("nope", "recipe 'nope': allowed eps_ablation, gamma_sweep", ["--scale", "tiny"]),
        ("gamma_sweep", "--steps 6: must be a positive integer, a multiple of 4 at the tiny scale",
         ["--scale", "tiny", "--steps", "6"]),
        ("lr_check", "argument --seeds: 0,x: must be comma-separated distinct integers >= 0, e.g. 0,1,2",
         ["--scale", "tiny", "--seeds", "0,x"]),
        ("scaling", "argument --seeds: 1,1: must be comma-separated distinct integers >= 0",
         ["--scale", "tiny", "--seeds", "1,1"]),
        ("scaling", "argument --seeds: -1: must be comma-separated distinct integers >= 0",
         ["--scale", "tiny", "--seeds=-1"]),
        ("gamma_sweep", "argument --steps: 0: must be an integer >= 1", ["--scale", "tiny", "--steps", "0"]),
        ("gamma_sweep", "argument --jobs: 0: must be an integer >= 1", ["--scale", "tiny", "--jobs", "0"]),
        ("moe", "recipe moe: --debug.seed: each run's seed sets it (seeds 0, 1, 2); choose the seeds with --seeds",
         ["--scale", "tiny", "--debug.seed", "3"]),
        ("eps_ablation", "model_args.dim", ["--scale", "tiny", "--model_args.dim", "63"]),
        ("scaling", "--launcher local: run 0.7B_standard needs 2 nodes", ["--scale", "paper", "--allow-epochs", "1e9"]),
        ("gate_ablation", "recipe gate_ablation: --gamma.attention_gate: the recipe varies it per run",
         ["--scale", "tiny", "--gamma.attention_gate", "none"]),
        ("moe", "recipe moe: --training.steps: the token budget sets it; use --steps N",
         ["--scale", "tiny", "--training.steps", "5"]),
        ("moe", "recipe moe: --job.dump_folder: each run trains in OUT/<run name>; choose OUT with --out",
         ["--scale", "tiny", "--job.dump_folder", "x"]),
        ("gate_ablation", "argument --allow-epochs: 0: must be a number > 0", ["--scale", "gpu", "--allow-epochs", "0"]),
        ("gate_ablation", "argument --allow-epochs: nan: must be a number > 0",
         ["--scale", "gpu", "--allow-epochs", "nan"]),
    ]
    bad = tmp_path / "bad.toml"
    bad.write_text('[recipe]\ntitle = "x"\n[grid]\n"gamma.init_rate" = [0.5]\n[scale.tiny]\ntokens = 1e6\n'
                   'models = ["configs/dense/tiny.toml"]\n[scale.papr]\n')
    cases.append((str(bad), "unknown [scale.papr]; the scales are tiny, gpu, paper", ["--scale", "tiny"]))
    claim = tmp_path / "claim.toml"
    claim.write_text('[recipe]\ntitle = "x"\n[grid]\n"gamma.init_rate" = [0.5, 1.0]\n[[claims]]\nclaim = "c"\n'
                     'vary = "gamma.norm_eps"\nvalues = [1, 2]\nexpect = "<0"\n[scale.tiny]\ntokens = 1e6\n'
                     'models = ["configs/dense/tiny.toml"]\n')
    cases.append((str(claim), "claims[0]: 'gamma.norm_eps' is not a key the recipe varies", ["--scale", "tiny"]))
    for key, value, message in (("debug.seed", 7, "[set] debug.seed: each run's seed sets it (seeds 0, 1, 2)"),
                                ("training.steps", 300, "[set] training.steps: the token budget sets it"),
                                ("gamma.init_rate", 1.0, "[set] gamma.init_rate: the recipe varies it per run")):
        own = tmp_path / f"set_{key}.toml"
        own.write_text(f'[recipe]\ntitle = "x"\n[set]\n"{key}" = {value}\n[grid]\n"gamma.init_rate" = [0.5, 1.0]\n'
                       '[scale.tiny]\ntokens = 1e6\nmodels = ["configs/dense/tiny.toml"]\n')
        cases.append((str(own), message, ["--scale", "tiny"]))
    for i, (name, message, args) in enumerate(cases):
        out = tmp_path / f"out-{i}"
        with pytest.raises(SystemExit) as exit_:
            main(["recipe", "run", name, *args, "--out", str(out)])
        stderr = capsys.readouterr().err
        assert exit_.value.code == 2, stderr
        assert stderr.count("\n") == 1 and stderr.startswith("error: ") and message in stderr, (message, stderr)
        assert not out.exists()


def test_power_law_fit_recovers_a_known_law():
    rng = np.random.default_rng(0)
    law = PowerLaw(E=1.69, A=406.4, alpha=0.34)  # Chinchilla's parameter term
    n = np.geomspace(1e8, 2e9, 6)
    noisy = law(n) * (1 + 1e-4 * rng.standard_normal(n.size))
    for points in (law(n), noisy):
        fit = fit_power_law(n, points)
        for got, want in ((fit.E, law.E), (fit.A, law.A), (fit.alpha, law.alpha)):
            assert abs(got / want - 1) < 0.05, (fit, law)
    exact = fit_power_law(n[:4], law(n[:4]))
    assert abs(exact.alpha / law.alpha - 1) < 1e-4 and abs(exact.E / law.E - 1) < 1e-5
    with pytest.raises(ValueError):
        fit_power_law(n[:2], law(n[:2]))


def test_effective_size_gain_between_known_laws():
    base = PowerLaw(E=2.0, A=50.0, alpha=0.3)
    # a model that behaves like the baseline at 1.79x its size: the gain is 1.79 at every N
    better = PowerLaw(E=2.0, A=50.0 * 1.79 ** -0.3, alpha=0.3)
    for n in (1e6, 1e8, 1e10):
        assert effective_size_gain(base, better, n) == pytest.approx(1.79, rel=1e-9)
    # different exponents: the gain follows N_base(L_small(N)) / N, worked by hand
    steeper = PowerLaw(E=2.0, A=60.0, alpha=0.35)
    n = 1e8
    expected = (50.0 / (60.0 * n ** -0.35)) ** (1 / 0.3) / n
    assert effective_size_gain(base, steeper, n) == pytest.approx(expected, rel=1e-9)
    assert effective_size_gain(base, PowerLaw(E=1.9, A=1.0, alpha=0.3), 1e12) == float("inf")


def test_report_pivots_every_setting_and_reads_the_latest_attempt(tmp_path):
    """A synthetic moe-shaped plan (model rows, γ columns, two arms): each cell is its own
    run's last validation loss, and a restarted run's older lines are dropped."""
    from gamma_titan.reports.recipe import write_report

    runs, losses = [], {}
    for model in ("small", "big"):
        for arm in ("standard", "adjusted"):
            for gamma in (0.5, 1.0):
                name = f"{model}_{arm}_g{gamma:g}"
                losses[name] = round(3 + gamma + (model == "big") + 0.1 * (arm == "adjusted"), 4)
                runs.append({"name": name, "model_label": model, "arm": arm, "values": {"gamma.init_rate": gamma},
                             "overrides": {}, "params": 1000, "params_non_embedding": 800 if model == "small" else 1600,
                             "tokens": 20000, "tokens_per_param": 20.0, "corpus_tokens": None, "steps": 4,
                             "global_batch": 1, "seq_len": 8})
                lines = [{"step": 1, "loss": 9.0, "val_loss": 9.0}, {"step": 4, "loss": 1.0, "val_loss": 99.0},
                         {"step": 2, "loss": 5.0}, {"step": 4, "loss": 4.0, "val_loss": losses[name]}]  # restart at 2
                (tmp_path / name).mkdir()
                (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    plan = {"recipe": "moe", "title": "t", "figure": "f", "expect": "e", "scale": "tiny", "grid": {"gamma.init_rate": [0.5, 1.0]},
            "arms": ["standard", "adjusted"], "report": {"rows": "model", "columns": "gamma.init_rate"}, "runs": runs}
    (tmp_path / "recipe.json").write_text(json.dumps(plan))
    text = write_report(tmp_path).read_text()
    table = text.split("**final validation loss**")[1].split("**")[0]
    assert "| model, arm | γ = 0.5 | γ = 1 | Δ (second − first) |" in table
    for model in ("small", "big"):
        for arm in ("standard", "adjusted"):
            a, b = losses[f"{model}_{arm}_g0.5"], losses[f"{model}_{arm}_g1"]
            assert f"| {model}, {arm} | {a:.4f} | {b:.4f} | {b - a:+.4f} |" in table
    assert "8 of 8 runs finished" in text and "99.0" not in text


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
def test_a_recipe_can_name_torchtitans_models(model, builtin_assets, tmp_path, capsys):
    """configs/titan/: the plan sizes TorchTitan's model by TorchTitan's own count and
    measures its σ²(h) as inspect does (γ-init set: the embedding's d^-2γ; unset: whatever
    TorchTitan's init gives, 1 for llama3's N(0, 1) embedding)."""
    recipe = tmp_path / f"{model}_gate.toml"
    recipe.write_text(f'[recipe]\ntitle = "{model} gate"\n[grid]\n"gamma.attention_gate" = ["none", "elementwise"]\n'
                      '"gamma.init_rate" = ["None", 1.0]\n[scale.tiny]\ntokens = 2e5\nseeds = [0]\n'
                      f'models = [{{ config = "configs/titan/{model}_debug.toml", flavor = "debugmodel" }}]\n')
    planned = plan_recipe(str(recipe), "tiny", out=str(tmp_path / "out"))
    assert execute(planned, dry_run=True) == 0
    runs = planned.runs
    assert len(runs) == 4 and len({r.params for r in runs}) == 2  # the gate adds n_layers x (dim x heads·hd)
    from gamma_titan.config import load_job_config
    from gamma_titan.inspect_model import inspect_model
    from gamma_titan.training.train_spec import resolve_model

    _, args = resolve_model(load_job_config(["--job.config_file", str(REPO / f"configs/titan/{model}_debug.toml")]))
    gate_params = args.n_layers * args.dim * args.n_heads * args.head_dim
    by_gate = {r.name.split("_")[0]: r.params for r in runs}  # runs are named gate<kind>_g<γ>_s<seed>
    assert by_gate["gateelementwise"] - by_gate["gatenone"] == gate_params
    gamma_runs = [r for r in runs if r.values["gamma.init_rate"] == 1.0]
    assert [r.hidden_var for r in gamma_runs] == [pytest.approx(args.dim ** -2.0, rel=0.05)] * 2
    titan_init = inspect_model(*resolve_model(load_job_config(
        ["--job.config_file", str(REPO / f"configs/titan/{model}_debug.toml"), "--gamma.init_rate", "None"])), 64)
    titan_runs = [r for r in runs if r not in gamma_runs]
    assert [r.hidden_var for r in titan_runs] == [pytest.approx(titan_init["hidden_var"], rel=0.05)] * 2
    assert {r.hidden_var_site for r in runs} == {"layers.*.attention_norm"}
    assert "epochs" in capsys.readouterr().out
