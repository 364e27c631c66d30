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


def test_an_asynchronous_save_that_finds_the_disk_full_names_its_own_step(tmp_path, builtin_assets):
    """checkpoint.async_mode = "async": step 4's save is written in the background and its
    failure surfaces only when the next save (step 6) awaits it. The line names step 4, not
    step 6; step 4's partial folder is removed; exit 4."""
    dump = tmp_path / "run"
    run = (*QUIET, "--gamma.diagnostics.enable", "false", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
           "--checkpoint.keep_latest_k", "0", "--training.steps", "8", "--checkpoint.async_mode", "async")
    full = run_trainer(dump, *run, *FAULT_INJECTION, check=False, env=faults(disk_full_at_step=4))
    assert full.returncode == 4, full.stdout[-2000:] + full.stderr[-3000:]
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint step-4: the disk is full ({dump / 'checkpoint'}: ") and \
        "step-2 is the newest complete one" in last, last
    assert "Traceback" not in full.stderr
    assert checkpoint_steps(dump / "checkpoint") == ([2], [])  # step-4's partial folder is gone


def test_a_stop_whose_asynchronous_save_finds_the_disk_full_exits_4_in_one_line(tmp_path, builtin_assets):
    """SIGTERM with checkpoint.async_mode = "async": the stop's save is awaited before the
    process exits; a full disk there is the same one line and exit 4, not a traceback."""
    from test_faults import sigterm_after_three_steps

    from helpers import trainer_command

    dump = tmp_path / "run"
    command, env = trainer_command(dump, *QUIET, "--gamma.diagnostics.enable", "false", "--checkpoint.enable", "true",
                                   "--checkpoint.interval", "1000", "--training.steps", "400",
                                   "--checkpoint.async_mode", "async", *FAULT_INJECTION,
                                   env=faults(disk_full_at_step=",".join(map(str, range(1, 401)))))
    code, out = sigterm_after_three_steps(command, env, dump, tmp_path / "log.txt")
    assert code == 4, out[-3000:]
    stopped = read_metrics(dump)[-1]["step"]
    assert out.strip().splitlines()[-1].startswith(f"error: checkpoint step-{stopped}: the disk is full"), out[-2000:]
    assert "Traceback" not in out and checkpoint_steps(dump / "checkpoint") == ([], [])


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
    with pytest.raises(ConfigError) as err:
        run_lock.check_free(dump)
    assert str(err.value).endswith(f"(it counts as gone {run_lock.STALE_SECONDS:.0f} s after its last heartbeat); if "
                                   f"that host is down, delete {lock} to take the folder over")
    old = time.time() - run_lock.STALE_SECONDS - 1
    os.utime(lock, (old, old))
    assert run_lock.holder(dump) is None


def test_a_requeued_slurm_job_takes_over_the_lock_of_its_earlier_start(tmp_path, monkeypatch):
    """SLURM requeues a job under the same id with SLURM_RESTART_COUNT + 1, and its rank 0
    may land on another node minutes later: the lock of the earlier start (another host, a
    fresh heartbeat) does not block it; another job's lock, or this start's, does."""
    dump = tmp_path / "run"
    dump.mkdir()
    lock = dump / run_lock.LOCK_FILE
    earlier = {"host": "n1-elsewhere", "pid": 12345, "started": "2026-12-04T10:00:00+00:00", "slurm_job": "77",
               "slurm_restart": 0}
    lock.write_text(json.dumps(earlier))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert run_lock.holder(dump) is None
    held = run_lock.RunLock(dump).acquire()
    assert json.loads(lock.read_text())["slurm_restart"] == 1
    held.release()
    lock.write_text(json.dumps({**earlier, "slurm_job": "78"}))  # another job
    assert run_lock.holder(dump)["slurm_job"] == "78"
    lock.write_text(json.dumps({**earlier, "slurm_restart": 1}))  # this very start, another host
    with pytest.raises(ConfigError, match="SLURM job 77, started"):
        run_lock.check_free(dump)


def test_the_heartbeat_outlives_a_failed_touch(tmp_path, monkeypatch):
    """A touch that fails (the file gone for a moment, as on a file server's hiccup) is said
    once and tried again: the lock's age is fresh again once the file is back."""
    monkeypatch.setattr(run_lock, "HEARTBEAT_SECONDS", 0.05)
    dump = tmp_path / "run"
    held = run_lock.RunLock(dump).acquire()
    lock = dump / run_lock.LOCK_FILE
    record = lock.read_text()
    lock.unlink()
    time.sleep(0.3)  # several failed beats
    lock.write_text(record)
    old = time.time() - 1000
    os.utime(lock, (old, old))
    deadline = time.monotonic() + 30
    while lock.stat().st_mtime < time.time() - 500 and time.monotonic() < deadline:
        time.sleep(0.05)
    held.release()
    assert not lock.exists()
    assert time.monotonic() < deadline, "the heartbeat stopped after its first failure"


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
