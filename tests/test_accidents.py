"""Accidents of a long run, each with one defined answer and nothing that existed lost:
the newest checkpoint damaged after its save, the disk full during a save, a second
launch into a live run's folder. (Ctrl-C: tests/test_faults.py.)"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from gamma_titan.config import load_job_config
from gamma_titan.errors import ConfigError
from gamma_titan.training import run_lock
from gamma_titan.training.checkpoint_folders import checkpoint_steps, damage, newest_intact
from gamma_titan.training.preflight import preflight, resume_notes
from helpers import DEBUG_TOML, FAULT_INJECTION, QUIET, REPO, faults, read_metrics, run_trainer


def save_checkpoint(folder, step: int) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"tok_embeddings.weight": torch.zeros(64, 8), "train_state": {"step": step}}, checkpoint_id=str(folder),
             no_dist=True)


def config_of(dump, *overrides):
    return load_job_config(["--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(dump),
                            "--checkpoint.enable", "true", *overrides])


@pytest.mark.parametrize("harm", ["missing", "truncated"])
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_newest_intact_one(tmp_path, harm):
    ckpt = tmp_path / "run" / "checkpoint"
    for step in (2, 4, 6):
        save_checkpoint(ckpt / f"step-{step}", step)
    data = next((ckpt / "step-6").glob("*.distcp"))
    size = data.stat().st_size
    if harm == "missing":
        data.unlink()
        expected = f"{data.name} is missing"
    else:
        os.truncate(data, size // 2)
        expected = f"{data.name} holds {size // 2:,} of its {size:,} bytes"
    assert damage(ckpt / "step-6") == expected and damage(ckpt / "step-4") is None
    assert newest_intact(ckpt) == (4, [(6, expected)])
    config = config_of(tmp_path / "run")
    preflight(config, world_size=1)
    assert config.checkpoint.load_step == 4  # what TorchTitan then loads
    [note] = resume_notes(config, 1)
    assert note == (f"checkpoint {ckpt / 'step-6'} is damaged (step-6: {expected}): resuming from step-4, the "
                    "newest intact one (the damaged folder is left as it is)")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4", "step-6"]  # nothing moved or removed
    # a step asked for explicitly is left to the user; none intact is refused in one line
    chosen = config_of(tmp_path / "run", "--checkpoint.load_step", "2")
    preflight(chosen, world_size=1)
    assert chosen.checkpoint.load_step == 2
    for step in (2, 4):
        next((ckpt / f"step-{step}").glob("*.distcp")).unlink()
    with pytest.raises(ConfigError, match=r"^checkpoint: every complete checkpoint in .* is damaged \(step-6: "):
        preflight(config_of(tmp_path / "run"), world_size=1)


def test_a_full_disk_stops_the_save_in_one_line_and_the_same_command_resumes(tmp_path, builtin_assets):
    """Step 4's save fails as a full disk does (ENOSPC, injected after its data files):
    one line naming the folder, exit 4, step-2 complete and loadable, no half step-4; with
    room again, the same command resumes from step 2 and finishes."""
    dump = tmp_path / "run"
    run = (*QUIET, "--gamma.diagnostics.enable", "false", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
           "--checkpoint.keep_latest_k", "0", "--training.steps", "6")
    full = run_trainer(dump, *run, *FAULT_INJECTION, check=False, env=faults(disk_full_at_step=4))
    assert full.returncode == 4, full.stdout[-2000:] + full.stderr[-3000:]
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint step-4: the disk is full ({dump / 'checkpoint'}: ") and \
        "step-2 is the newest complete one, and stays loadable. Make room and run the same command" in last
    assert "Traceback" not in full.stderr
    assert checkpoint_steps(dump / "checkpoint") == ([2], []) and damage(dump / "checkpoint" / "step-2") is None
    run_trainer(dump, *run)
    steps = [r["step"] for r in read_metrics(dump)]
    assert steps == [1, 2, 3, 4, 3, 4, 5, 6] and checkpoint_steps(dump / "checkpoint") == ([2, 4, 6], [])
    assert not (dump / run_lock.LOCK_FILE).exists()  # released at the end


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_run_holds_its_folder_and_a_dead_ones_lock_does_not_block(tmp_path):
    dump = tmp_path / "run"
    dump.mkdir()
    lock = dump / run_lock.LOCK_FILE
    mine = {"host": socket.gethostname(), "pid": os.getppid(), "started": "2026-12-04T10:00:00+00:00"}
    lock.write_text(json.dumps(mine))
    with pytest.raises(ConfigError) as err:
        run_lock.check_free(dump)
    assert str(err.value) == (f"job.dump_folder: {dump} is in use by a live run (host {mine['host']}, pid "
                              f"{mine['pid']}, started 2026-12-04T10:00:00+00:00); wait for it to end, stop it, "
                              "or use another job.dump_folder")
    lock.write_text(json.dumps({**mine, "pid": dead_pid()}))  # a run that died: no block
    assert run_lock.holder(dump) is None
    held = run_lock.RunLock(dump).acquire()  # ... and its lock is taken over
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    held.release()
    assert not lock.exists()
    # another host: alive while its heartbeat is fresh
    lock.write_text(json.dumps({**mine, "host": "elsewhere"}))
    assert run_lock.holder(dump)["host"] == "elsewhere"
    old = time.time() - run_lock.STALE_SECONDS - 1
    os.utime(lock, (old, old))
    assert run_lock.holder(dump) is None


def test_a_second_launch_into_a_live_runs_folder_is_refused_before_it_starts(tmp_path, builtin_assets):
    dump = tmp_path / "run"
    dump.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # killed below
    try:
        (dump / run_lock.LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid,
                                                          "started": "2026-12-04T10:00:00+00:00"}))
        proc = subprocess.run([sys.executable, "-m", "gamma_titan.cli", "train", str(DEBUG_TOML), "--job.dump_folder",
                               str(dump), "--training.steps", "2"], capture_output=True, text=True, timeout=300,
                              cwd=REPO)
    finally:
        holder.kill()
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: job.dump_folder: {dump} is in use by a live run (host {socket.gethostname()}, pid {holder.pid}, "
        "started 2026-12-04T10:00:00+00:00); wait for it to end, stop it, or use another job.dump_folder")
    assert sorted(p.name for p in dump.iterdir()) == [run_lock.LOCK_FILE]  # nothing written
