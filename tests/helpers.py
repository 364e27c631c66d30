"""Helpers for the tests: small model args, and running the trainer as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gamma_titan  # noqa: F401  (platform shims before torchtitan)

REPO = Path(__file__).resolve().parents[1]
DEBUG_TOML = REPO / "configs" / "dense" / "debug.toml"


def small_args(gamma: float = 1.0, gate: str = "elementwise", eps: float = 1e-12, **shape):
    """debug-flavor args with a chosen shape and the three knobs."""
    from gamma_titan.models.dense import dense_flavors

    args = dense_flavors["debug"]
    for key, value in shape.items():
        setattr(args, key, value)
    args.init.rate = gamma
    args.norm_eps = eps
    args.attention_gate = gate
    args.check()
    return args


def family_debug_config(name: str) -> tuple[Path, tuple[str, ...]]:
    """The config a registered family is tried with: its debug config (configs/dense/debug.toml,
    configs/titan/llama3_debug.toml, ...), or for a family that ships none, the dense one
    naming the family and its first flavor."""
    import tomllib

    from gamma_titan.models import TRAIN_SPECS

    for path in sorted((REPO / "configs").glob("*/*debug.toml")):
        if tomllib.loads(path.read_text())["model"]["name"] == name:
            return path, ()
    first = next(iter(TRAIN_SPECS[name].model_args))
    return DEBUG_TOML, ("--model.name", name, "--model.flavor", first)


def relative(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two equally long lists of numbers."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def launch_cases(out: Path, world: int, cases: list[dict], timeout: int = 1200) -> None:
    """Train `cases` ({"name", "argv", "save", "reference", "resume_from"}, reference and
    resume_from naming other cases) one after another in one launch of `world` processes
    (tests/scripts/layout_matrix.py), into out/<name>/."""
    spec = out / f"cases-{world}-{cases[0]['name']}.json"
    spec.write_text(json.dumps([{"name": c["name"], "argv": [str(a) for a in c["argv"]], "save": c.get("save", False),
                                 "reference": c.get("reference") and str(out / c["reference"]),
                                 "resume_from": c.get("resume_from") and str(out / c["resume_from"])}
                                for c in cases]))
    script = str(REPO / "tests" / "scripts" / "layout_matrix.py")
    argv = [sys.executable, script, str(out), str(spec)]
    if world > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                *argv[1:]]
    threads = max(1, (os.cpu_count() or 2) // (world * xdist_workers()))
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    assert proc.returncode == 0, f"world {world}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def key_reads_of(runs: list[tuple[list[str], Path]]) -> tuple[list[str], list[str]]:
    """Measured key support of runs of tests/scripts/layout_matrix.py (each
    `(argv, its folder)`; the folder's run.json holds the keys read from the trainer's start
    to its close, on any rank, with their readers). Returns
      * "case: key" for each key a run sets to a value other than its default that its
        trainer never reads (a copy into a record is no read), that no code before the
        trainer reads, and that waits for no switch that is off: accepted and then ignored;
      * each TorchTitan key that no run reads although it is on in some run and not
        refused by pre-flight (UNREAD, or unsupported_keys of every family among the runs).
    The runs of one launch share one process group, whose keys (`comm.*`) the launch's first
    case reads: pass every run of a launch."""
    from gamma_titan.config import load_job_config
    from gamma_titan.config.key_support import (READ_BEFORE_THE_TRAINER, UNREAD, changed_keys,
                                                effective_readers, waiting)
    from gamma_titan.config.titan_keys import titan_fields
    from gamma_titan.training.layout import LayoutRules
    from gamma_titan.training.train_spec import resolve_model

    read, ignored, configs, layouts = set(), [], [], []
    for argv, folder in runs:
        record = json.loads((folder / "run.json").read_text())
        reads = record["key_reads"]
        assert len(reads) > 100 and "training.steps" in reads, (folder, sorted(reads))
        config = load_job_config([*argv, "--job.dump_folder", str(folder)])
        _, args = resolve_model(config)
        layout = LayoutRules(args, config.model.name, cuda=False).resolve(config.parallelism, record["world"])
        configs.append(config)
        layouts.append(layout)
        these = {key for key, readers in reads.items() if effective_readers(readers)}
        read |= these
        ignored += [f"{folder.name}: {key}" for key in changed_keys(config)
                    if key not in these and key not in READ_BEFORE_THE_TRAINER and not waiting(config, key, layout)]
    # refused: for no code to read (UNREAD), or by every family among the runs
    unsupported = [set(resolve_model(config)[1].unsupported_keys()) for config in configs]
    refused = set(UNREAD) | set.intersection(*unsupported) | set(READ_BEFORE_THE_TRAINER)
    never = [key for key in titan_fields() if key not in read and key not in refused
             and not all(waiting(config, key, layout) for config, layout in zip(configs, layouts))]
    return ignored, never


def xdist_workers() -> int:
    """pytest-xdist workers running side by side (tools/test.sh uses 2): they share the cores."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


#: Loads tests/scripts/fault_injection.py into a trainer; `faults(...)` says what it breaks.
FAULT_INJECTION = ("--experimental.custom_import", "fault_injection")


def faults(**settings) -> dict[str, str]:
    """The environment for FAULT_INJECTION, e.g. faults(nan_at_steps="3", kill_at_step="7",
    kill_in_save_at_step="6", save_delay="40"): tests/scripts on PYTHONPATH and the
    GAMMA_TITAN_TEST_* variables."""
    path = os.pathsep.join(filter(None, [str(REPO / "tests" / "scripts"), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, **{f"GAMMA_TITAN_TEST_{k.upper()}": str(v) for k, v in settings.items()}}


def trainer_command(dump: Path, *overrides: str, nproc: int = 1, config: Path = DEBUG_TOML,
                    env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of `torchrun -m gamma_titan.train` (plain python
    for one process), as a user would launch it; `env` adds to the environment."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // (nproc * xdist_workers()))),
           **(env or {})}
    argv = ["-m", "gamma_titan.train", "--job.config_file", str(config),
            "--job.dump_folder", str(dump), *overrides]
    if nproc > 1:  # the project's torchrun (gamma-titan train --nproc N runs it)
        from gamma_titan.training.launch import TORCHRUN

        argv = ["-m", TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *argv]
    return [sys.executable, *argv], env


def run_trainer(dump: Path, *overrides: str, nproc: int = 1, config: Path = DEBUG_TOML,
                timeout: int = 600, check: bool = True, env: dict[str, str] | None = None,
                cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run the trainer to the end, in `cwd` (a relative `dump` is taken from there); with
    `check`, fail the test unless it exits 0."""
    command, env = trainer_command(dump, *overrides, nproc=nproc, config=config, env=env)
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if not check:
        return proc
    if proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


QUIET = ("--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
         "--validation.enable", "false")


def hf_checkpointer(root, folder, model, model_name, args, tokenizer, **checkpoint):
    """GammaCheckpointManager as GammaTrainer builds it (the TrainSpec's state-dict adapter on
    `model.hf_assets_path`, "builtin" in our configs), for a model-only save or load."""
    import torch
    from torchtitan.config import Checkpoint

    from gamma_titan.convert.model_record import model_record
    from gamma_titan.models import TRAIN_SPECS
    from gamma_titan.training.checkpoint import GammaCheckpointManager

    return GammaCheckpointManager(
        model_record=model_record(model_name, "debug", args, tokenizer), device=torch.device("cpu"),
        dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
        checkpoint_config=Checkpoint(enable=True, folder=folder, **checkpoint),
        sd_adapter=TRAIN_SPECS[model_name].state_dict_adapter(args, "builtin"), base_folder=str(root))


#: Programs whose command lines the README's code blocks give.
README_PROGRAMS = ("gamma-titan", ".venv/bin/gamma-titan", "torchrun", "python", ".venv/bin/python", "bash")


def readme_code_blocks(readme: str, language: str) -> list[str]:
    """The bodies of the README's ```language blocks."""
    import re

    return re.findall(rf"^```{language}\n(.*?)^```", readme, flags=re.S | re.M)


def readme_commands(readme: str) -> list[list[str]]:
    """Every command line of the README's bash blocks, as argv (continuations joined,
    comments dropped, `a && b` split; a synopsis's second line, starting with `[`, joined
    to its first); shell syntax (`for`, `done`) is skipped."""
    import shlex

    found = []
    for block in readme_code_blocks(readme, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0].startswith("[") and found:
                found[-1] += words
                continue
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                if words[0] in README_PROGRAMS:
                    found.append(words[:cut])
                words = words[cut + 1:]
    return found
