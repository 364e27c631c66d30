"""Faults injected into 2-process FSDP runs ([gamma.reliability]), and what survives them:
rank 0 killed (SIGKILL) inside a checkpoint write, then the last rank killed mid-training,
then a plain restart (every step's loss equals an uninterrupted run's, bitwise, and no
complete checkpoint is lost); SIGTERM through torchrun. Single-process faults are in
tests/test_faults.py."""

import json

import pytest

from helpers import FAULT_INJECTION, faults, read_metrics, run_trainer
from test_faults import CHECKPOINTS, FAST, complete_steps, sigterm_then_resume

pytestmark = pytest.mark.multiprocess


def test_sigterm_through_torchrun_checkpoints_both_ranks_at_the_same_step(tmp_path, builtin_assets):
    sigterm_then_resume(tmp_path, nproc=2)


def test_killed_ranks_lose_nothing(tmp_path, builtin_assets):
    """2-process FSDP with a checkpoint every 2 steps (all kept)."""
    run = (*FAST, *CHECKPOINTS, "--training.steps", "8")
    reference = tmp_path / "reference"
    run_trainer(reference, *run, nproc=2)
    expected = {r["step"]: r["loss"] for r in read_metrics(reference)}
    assert sorted(expected) == list(range(1, 9))

    dump = tmp_path / "run"
    # 1. rank 0 dies inside the write of step 6's checkpoint: step-4 stays the last complete one.
    killed = run_trainer(dump, *run, *FAULT_INJECTION, nproc=2, check=False, env=faults(kill_in_save_at_step=6))
    assert killed.returncode != 0
    assert complete_steps(dump) == ([2, 4], [6])
    # 2. restarted, it reports step-6 as incomplete, resumes from step-4, then the last rank
    #    dies as step 7 starts (step 6 is now saved whole).
    killed = run_trainer(dump, *run, *FAULT_INJECTION, nproc=2, check=False, env=faults(kill_at_step=7))
    assert killed.returncode != 0
    assert "incomplete checkpoint(s)" in killed.stdout + killed.stderr and "step-6" in killed.stdout + killed.stderr
    assert complete_steps(dump) == ([2, 4, 6], [])
    # 3. a plain restart finishes the run from step-6.
    run_trainer(dump, *run, nproc=2)
    assert complete_steps(dump) == ([2, 4, 6, 8], [])

    logged = read_metrics(dump)  # appended by all three runs: 1-6, 5-6, 7-8
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    assert all(r["loss"] == expected[r["step"]] for r in logged), json.dumps(logged)


def test_a_rank_that_does_not_yet_see_the_checkpoint_resumes_where_rank_0_does(tmp_path, builtin_assets):
    """Two nodes of a shared filesystem can see the run folder differently for a while: rank
    1 here finds no checkpoint at all (tests/scripts/fault_injection.py). Rank 0's reading is
    every rank's: both resume from step 4, and steps 5-8 are those of an uninterrupted run."""
    run = (*FAST, "--checkpoint.enable", "true", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0",
           "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0")  # a schedule blind to training.steps
    reference = tmp_path / "reference"
    run_trainer(reference, *run, "--training.steps", "8", nproc=2)
    dump = tmp_path / "run"
    run_trainer(dump, *run, "--training.steps", "4", nproc=2)
    resumed = run_trainer(dump, *run, *FAULT_INJECTION, "--training.steps", "8", nproc=2, timeout=300,
                          env=faults(blind_rank=1))
    assert "Loading the checkpoint from" in resumed.stdout + resumed.stderr
    expected = {r["step"]: r["loss"] for r in read_metrics(reference)}
    assert [(r["step"], r["loss"]) for r in read_metrics(dump)] == [(s, expected[s]) for s in [1, 2, 3, 4, 5, 6, 7, 8]]


def test_a_failure_on_rank_1_prints_its_traceback_once(tmp_path, builtin_assets):
    """The launch `gamma-titan train --nproc 2` makes (torchrun with --local-ranks-filter=0:
    rank 1's own output is not shown), rank 1 failing outside TorchTitan's recorded Trainer
    methods (as the trainer closes): torchrun's summary names it with its traceback, once.
    Before gamma_titan.training.main.main was recorded: `error_file: <N/A>` and no traceback."""
    import os
    import subprocess

    from gamma_titan.training.launch import torchrun_command
    from helpers import DEBUG_TOML, REPO

    argv = ["--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(tmp_path / "run"), *FAST,
            "--training.steps", "2", *FAULT_INJECTION]
    command, env = torchrun_command(2, argv, 300, threads=1)
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**env, **faults(fail_in_close_rank="1"), "PYTHONPATH": faults()["PYTHONPATH"]})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "--local-ranks-filter" in command, command
    assert out.count("RuntimeError: fault_injection: rank 1 fails as the trainer closes") == 1, out[-4000:]
    root = out.split("Root Cause (first observed failure):")[1]  # (rank 0, SIGTERM'd by torchrun, is listed above)
    assert "rank      : 1 (local_rank: 1)" in root and "error_file: <N/A>" not in root, root
    assert "traceback : Traceback (most recent call last):" in root and "in close\n" in root, root


def test_a_save_slower_than_the_training_timeout_completes_and_so_does_a_stops(tmp_path, builtin_assets):
    """2 gloo ranks with comm.train_timeout_seconds = 3 (TorchTitan sets every group to it after
    step 1), rank 0's save held 8 s before its .metadata (a slow writer on a shared file
    system): the save at step 2 completes; a SIGTERM stop's save, held as long, completes and
    the run exits 0. Before: exit 1, DCP's all_reduce("write") "Timed out waiting 3000ms",
    step-2 left without .metadata."""
    import shutil

    from test_faults import sigterm_after_three_steps
    from helpers import trainer_command

    dump = tmp_path / "run"
    run = (*FAST, "--checkpoint.enable", "true", "--checkpoint.interval", "1000", "--comm.train_timeout_seconds", "3",
           *FAULT_INJECTION)
    done = run_trainer(dump, *run, "--training.steps", "2", nproc=2, check=False, env=faults(save_delay=8))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert complete_steps(dump) == ([2], []) and "Timed out" not in out
    # the stop's save, held as long, in the same run resumed (in a folder of its own: the helper
    # signals once three steps are logged there)
    resumed = tmp_path / "resumed"
    shutil.copytree(dump / "checkpoint", resumed / "checkpoint")
    command, env = trainer_command(resumed, *run, "--training.steps", "400", nproc=2,
                                   env=faults(save_delay=8, step_seconds=0.2))
    code, out = sigterm_after_three_steps(command, env, resumed, tmp_path / "log.txt", timeout=180)
    assert code == 0 and "Traceback" not in out and "Timed out" not in out, out[-4000:]
    last = read_metrics(resumed)[-1]["step"]
    assert complete_steps(resumed) == ([2, last], []) and last > 2
    assert f"gamma-titan: SIGTERM: every worker of this node checkpointed step {last}" in out
