"""Faults injected into real training runs ([gamma.reliability]), and what survives them.

  * a poisoned batch (NaN loss) is skipped, or stops the run, and no checkpoint holds NaN;
  * SIGTERM checkpoints the step in progress and exits 0, and the run resumes from it;
  * (2-process FSDP kills and SIGTERM through torchrun: tests/test_faults_distributed.py)
"""

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import DEBUG_TOML, FAULT_INJECTION, QUIET, REPO, faults, read_metrics, run_trainer, trainer_command

pytestmark = pytest.mark.multiprocess

FAST = (*QUIET, "--gamma.diagnostics.enable", "false")
CHECKPOINTS = ("--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0")


def complete_steps(dump):
    from gamma_titan.training.checkpoint_folders import checkpoint_steps

    return checkpoint_steps(dump / "checkpoint")


def assert_finite_checkpoint(path):
    from gamma_titan.convert.dcp_io import load_model_state

    state = load_model_state(path)
    assert state and all(torch.isfinite(t).all() for t in state.values())


def test_poisoned_batch_is_skipped_and_a_spike_names_its_data(tmp_path, builtin_assets):
    dump = tmp_path / "run"
    run_trainer(dump, *FAST, *CHECKPOINTS, *FAULT_INJECTION, "--training.steps", "6",
                "--gamma.reliability.loss_spike_window", "2", env=faults(nan_at_steps=3, spike_at_steps=5))
    records = {r["step"]: r for r in read_metrics(dump)}
    assert records[3]["nonfinite_skipped"]["skipped_so_far"] == 1 and math.isnan(records[3]["loss"])
    assert all(math.isfinite(records[s]["loss"]) for s in (1, 2, 4, 5, 6))
    assert not any("nonfinite_skipped" in records[s] for s in (1, 2, 4, 5, 6))
    # The spike at step 5, against the mean of the last two finite losses (steps 2 and 4),
    # with the sequences of its global batch: [(step-1)·G, step·G), G = 8 sequences (1 rank).
    spike = records[5]["loss_spike"]
    assert spike["loss"] == pytest.approx(records[5]["loss"], rel=1e-6) and spike["loss"] > 1.5 * spike["running_mean"]
    assert spike["running_mean"] == pytest.approx((records[2]["loss"] + records[4]["loss"]) / 2, rel=1e-6)
    assert spike["global_batch"] == 4 and spike["sequences"] == [32, 40]
    assert not any("loss_spike" in records[s] for s in (1, 2, 3, 4))
    # No update at step 3: the warm-up schedule did not advance either.
    assert records[2]["lr"] < records[3]["lr"] == records[4]["lr"] < records[5]["lr"]
    assert complete_steps(dump) == ([2, 4, 6], [])
    for step in (2, 4, 6):
        assert_finite_checkpoint(dump / "checkpoint" / f"step-{step}")


def test_poisoned_batch_stops_the_run_when_configured(tmp_path, builtin_assets):
    dump = tmp_path / "run"
    proc = run_trainer(dump, *FAST, *CHECKPOINTS, *FAULT_INJECTION, "--training.steps", "6",
                       "--gamma.reliability.on_nonfinite", "stop", check=False, env=faults(nan_at_steps=3))
    assert proc.returncode == 3
    assert "error: step 3: non-finite loss (nan)" in proc.stderr
    assert complete_steps(dump) == ([2], [])
    assert_finite_checkpoint(dump / "checkpoint" / "step-2")


def sigterm_after_three_steps(command: list[str], env: dict, dump, log, timeout: int = 120,
                              sig: int = signal.SIGTERM) -> tuple[int, str]:
    """Start a run, send it `sig` once three steps are logged, wait; (exit code, log text)."""
    with open(log, "w") as sink:  # a file, not a pipe: nobody reads a pipe while training runs
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 300
            while not ((dump / "metrics.jsonl").exists() and len(read_metrics(dump)) >= 3):
                assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it was stopped"
                time.sleep(0.2)
            proc.send_signal(sig)
            proc.wait(timeout=timeout)
        finally:
            proc.kill()
    return proc.returncode, log.read_text()


def sigterm_then_resume(tmp_path, nproc: int, *extra: str, sig: int = signal.SIGTERM) -> None:
    """One process: SIGTERM (or Ctrl-C's SIGINT) to it, then resume. Two: SIGTERM to the
    project's torchrun, which forwards it to both ranks; every rank checkpoints the same step
    and torchrun exits 0, in one line, no traceback (torch's own exits 1 after any signal)."""
    dump = tmp_path / "run"
    command, env = trainer_command(dump, *FAST, "--checkpoint.enable", "true", "--checkpoint.interval", "1000",
                                   "--training.steps", "400", *extra, nproc=nproc)
    code, out = sigterm_after_three_steps(command, env, dump, tmp_path / "log.txt", sig=sig)
    if sig == signal.SIGINT:  # Ctrl-C: the same clean stop, no KeyboardInterrupt traceback
        assert "SIGINT: finishing this step, checkpointing it and exiting" in out and "Traceback" not in out, out[-3000:]
    assert code == 0 and "Traceback" not in out, out[-3000:]
    if nproc > 1:
        assert "gamma-titan: SIGTERM: every worker of this node checkpointed step" in out, out[-3000:]
    assert "Training completed" not in out and "stopped at step" in out  # TorchTitan's line would be untrue
    last = read_metrics(dump)[-1]["step"]
    assert 3 <= last < 400
    assert complete_steps(dump) == ([last], [])
    # every rank, the same step, under the name of the signal it got (Ctrl-C's is SIGINT)
    assert out.count(f"{signal.Signals(sig).name}: checkpointed step {last}") == nproc
    if nproc == 1:  # the last lines name the checkpoint just written
        assert f"last checkpoint: {dump.resolve() / 'checkpoint' / f'step-{last}'}" in out, out[-3000:]

    if nproc > 1:
        return  # 2-rank resumes are tested in tests/test_faults_distributed.py
    run_trainer(dump, *FAST, "--checkpoint.enable", "true", "--checkpoint.interval", "1000",
                "--training.steps", str(last + 2), *extra)
    assert [r["step"] for r in read_metrics(dump)][-3:] == [last, last + 1, last + 2]


def test_ctrl_c_checkpoints_the_current_step_as_sigterm_does_and_the_run_resumes(tmp_path, builtin_assets):
    """SIGINT (Ctrl-C at a terminal) to one process; SIGTERM to one process is the GPU check's
    drill (tools/gpu_check.sh --dry-run, tests/test_gpu_check.py), to torchrun below."""
    sigterm_then_resume(tmp_path, nproc=1, sig=signal.SIGINT)


def test_sigterm_waits_for_an_async_checkpoint_in_flight(tmp_path, builtin_assets):
    """checkpoint.async_mode = "async": the SIGTERM save is written in the background, and
    the run must not exit before it is complete."""
    sigterm_then_resume(tmp_path, 1, "--checkpoint.async_mode", "async")


SAVE_DELAY = 40  # seconds: more than torchrun's default 30 s between its SIGTERM and SIGKILL


def test_sigterm_under_torchrun_survives_a_save_slower_than_30_seconds(tmp_path, builtin_assets):
    """Hazard 3: the torchrun that `gamma-titan train` (and a recipe) starts gets a
    --shutdown-timeout of the grace period plus a margin, so a checkpoint that takes longer
    than torchrun's default 30 s to write (as a 7B save does) still completes after SIGTERM,
    and the run resumes from it. (One rank, under torchrun: `--nproc 1` itself trains in
    its own process, where no torchrun stands between SIGTERM and the save.)"""
    from gamma_titan.training.launch import torchrun_command

    dump = tmp_path / "run"
    run = (*FAST, "--checkpoint.enable", "true", "--checkpoint.interval", "1000")
    argv = ["--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(dump), *run, "--training.steps", "400",
            *FAULT_INJECTION]
    command, env = torchrun_command(1, argv, 300.0)
    env = {**env, "OMP_NUM_THREADS": "1", **faults(save_delay=SAVE_DELAY)}
    code, out = sigterm_after_three_steps(command, env, dump, tmp_path / "log.txt", timeout=SAVE_DELAY + 120)
    assert "--shutdown-timeout=360" in command and f"waiting {SAVE_DELAY} s before .metadata" in out, out[-3000:]
    assert code == 0 and "Traceback" not in out, out[-3000:]
    last = read_metrics(dump)[-1]["step"]
    assert complete_steps(dump) == ([last], []), out[-3000:]
    assert f"SIGTERM: checkpointed step {last}" in out
    run_trainer(dump, *run, "--training.steps", str(last + 2))
    assert [r["step"] for r in read_metrics(dump)][-3:] == [last, last + 1, last + 2]


def test_a_second_ctrl_c_under_torchrun_ends_the_command_at_once(tmp_path, builtin_assets):
    """Ctrl-C reaches torchrun (its workers run in sessions of their own), which forwards it;
    a second Ctrl-C while the stop's save is in flight (held 40 s here) reaches the worker as
    torchrun's SIGTERM: it exits at once, torchrun exits 130 in one line, and the half-written
    checkpoint is not taken for a complete one."""
    from gamma_titan.training.launch import torchrun_command

    dump = tmp_path / "run"
    argv = ["--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(dump), *FAST, "--checkpoint.enable",
            "true", "--checkpoint.interval", "1000", "--training.steps", "400", *FAULT_INJECTION]
    command, env = torchrun_command(1, argv, 300.0)
    env = {**env, "OMP_NUM_THREADS": "1", **faults(save_delay=SAVE_DELAY)}
    log = tmp_path / "log.txt"
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 300
            while not (dump / "metrics.jsonl").exists() or len(read_metrics(dump)) < 3:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            while f"waiting {SAVE_DELAY} s before .metadata" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            second = time.monotonic()
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=SAVE_DELAY + 60)
            seconds = time.monotonic() - second
        finally:
            proc.kill()
    out = log.read_text()
    assert proc.returncode == 130 and seconds < SAVE_DELAY / 2, (proc.returncode, seconds, out[-3000:])
    assert "SIGTERM after SIGINT: exiting now without a new checkpoint" in out, out[-3000:]
    assert "Traceback" not in out and out.strip().splitlines()[-1].startswith("gamma-titan: SIGINT: local rank(s) 0")
    complete, incomplete = complete_steps(dump)
    assert complete == [] and len(incomplete) == 1  # the stop's save never got its .metadata
