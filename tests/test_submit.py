"""`gamma-titan submit` and `gamma-titan status` without a cluster: site files and flags,
the job script they write, what the job decides at each stop, the rendezvous it picks, and
every bad input refused in one line before anything is written. The real SLURM runs the
scripts in test_slurm.py."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from gamma_titan.errors import ConfigError
from gamma_titan.slurm import job as job_step
from gamma_titan.slurm import records
from gamma_titan.slurm.script import JobSpec, job_script
from gamma_titan.slurm.site import SITE_ENV, Site, load_site, read_site, time_minutes

TINY = REPO / "configs/dense/tiny.toml"


@pytest.fixture
def cli(monkeypatch, capsys):
    """`gamma-titan ...` in this process (a command's own process would import torch again):
    run in `cwd`, with `env` added; its exit code, standard output and error."""

    def run(*argv, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
        from gamma_titan.cli import main

        monkeypatch.chdir(cwd)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            main([str(a) for a in argv])
        printed = capsys.readouterr()
        return subprocess.CompletedProcess(argv, done.value.code, printed.out, printed.err)

    return run


# --- site settings ----------------------------------------------------------------------------

SITE = """partition = "gpu"
account = "proj42"
qos = "normal"
constraint = "h100"
time = "2-00:00:00"
gpus_per_node = 8
sbatch = ["--mail-type=END", "--reservation=big"]
setup = ["module load cuda/12.4", "source /shared/gt/.venv/bin/activate"]
[env]
NCCL_SOCKET_IFNAME = "ib0"
NCCL_DEBUG = "WARN"
[container]
prefix = "apptainer exec --nv /shared/gt.sif"
"""


def spec(tmp_path: Path, **changes) -> JobSpec:
    values = dict(name="gt-x", run_dir=tmp_path / "run", train_argv=["--job.config_file", "c.toml"], nodes=2,
                  ranks_per_node=8, gpus_per_node=8, grace_seconds=300, script=tmp_path / "run/slurm/job.sbatch",
                  log=tmp_path / "run/slurm/job-%j.out", workdir=tmp_path, launch_command="sbatch x")
    return JobSpec(**{**values, **changes})


def test_a_site_file_becomes_sbatch_and_setup_lines_that_resubmit_alone(tmp_path):
    path = tmp_path / "site.toml"
    path.write_text(SITE)
    site = read_site(path)
    text = job_script(spec(tmp_path), site)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    for line in ("--partition=gpu", "--account=proj42", "--qos=normal", "--constraint=h100", "--time=2-00:00:00",
                 "--exclusive", "--mail-type=END", "--reservation=big", "--gpus-per-node=8", "--nodes=2"):
        assert f"#SBATCH {line}\n" in text, line
    # the setup lines and the environment run before anything of ours, in the order given
    setup = text.index("module load cuda/12.4\nsource /shared/gt/.venv/bin/activate\n")
    assert setup < text.index("export NCCL_SOCKET_IFNAME=ib0\nexport NCCL_DEBUG=WARN\n") < text.index("helper start")
    # a container prefix wraps the training and every step of ours on the node; the Python is
    # the container's (setup lines or a container: not this machine's path)
    assert "here=(apptainer exec --nv /shared/gt.sif)" in text
    assert 'apptainer exec --nv /shared/gt.sif "$PYTHON" -m gamma_titan.training.torchrun' in text
    assert "PYTHON=python\n" in text
    # flags win over the file, and --sbatch lines add to its own
    flagged = site.merged(partition="debug", time="30", sbatch=["--comment=x"])
    assert flagged.sbatch_lines()[:1] == ["--partition=debug"] and "--time=30" in flagged.sbatch_lines()
    assert flagged.sbatch[-1] == "--comment=x" and "--mail-type=END" in flagged.sbatch


def test_a_pyxis_container_runs_the_training_and_the_jobs_own_steps_in_it(tmp_path):
    path = tmp_path / "site.toml"
    path.write_text('[container]\nimage = "nvcr.io#nvidia/pytorch:25.01-py3"\nmounts = ["/lustre:/lustre", "/home"]\n'
                    'workdir = "/lustre/gt"\n')
    text = job_script(spec(tmp_path), read_site(path))
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    # (the # of an image name quoted: a shell would read the rest of the line as a comment)
    options = "'--container-image=nvcr.io#nvidia/pytorch:25.01-py3' --container-mounts=/lustre:/lustre,/home " \
              "--container-workdir=/lustre/gt"
    assert f'here=(srun --overlap --nodes=1 --ntasks=1 -w "$SLURMD_NODENAME" {options})' in text
    assert f'{options} "$PYTHON" -m gamma_titan.training.torchrun' in text
    # SLURM's own commands stay outside the container, in the script: the steps of ours get
    # `scontrol show job` through the environment
    assert 'GAMMA_TITAN_JOB="$(scontrol show job "$SLURM_JOB_ID")" helper after-stop' in text
    assert "subprocess" not in (REPO / "gamma_titan/slurm/job.py").read_text()  # they run no command themselves


@pytest.mark.parametrize("text, message", [
    ('partiton = "gpu"\n', "unknown key 'partiton'; allowed: partition, account, qos"),
    ("gpus_per_node = \"8\"\n", "gpus_per_node = '8': must be an integer"),
    ("exclusive = 1\n", "exclusive = 1: must be true or false"),
    ('sbatch = ["--nodes=4"]\n', "sbatch: '--nodes=4': the job script sets --nodes itself (use --nodes)"),
    ('sbatch = ["--signal=B:USR1@60"]\n', "the job script sets --signal itself (the job signals itself"),
    ('sbatch = ["-p gpu"]\n', "sbatch: '-p gpu': the job script sets -p itself (use partition)"),
    ('sbatch = ["mail-type=END"]\n', "sbatch: 'mail-type=END' is not an sbatch option"),
    ('time = "2 days"\n', "time = '2 days': not a SLURM time"),
    ('setup = "module load x"\n', "setup = 'module load x': must be a list of strings"),
    ('[container]\nimage = "a.sqsh"\nprefix = "apptainer exec b.sif"\n', "container: give image (pyxis) or prefix"),
    ('[container]\nimg = "a.sqsh"\n', "unknown key container.'img'; allowed: image, mounts, workdir, prefix"),
    ('[env]\n"NOT A NAME" = "x"\n', "env.NOT A NAME: not an environment variable name"),
    ('[env]\nA = ["x"]\n', "env.A = ['x']: must be a string or a number"),
    ('partition = "gpu\n', "damaged TOML (Illegal character"),
])
def test_a_bad_site_file_is_one_line_naming_the_file_and_the_key(tmp_path, text, message):
    path = tmp_path / "site.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_site(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value) and "\n" not in str(err.value)


def test_the_site_file_can_come_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "site.toml"
    path.write_text('account = "from-env"\n')
    monkeypatch.setenv(SITE_ENV, str(path))
    assert load_site(None).account == "from-env"
    assert load_site(None).merged(account="flag").account == "flag"
    monkeypatch.setenv(SITE_ENV, str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match=rf"^\${SITE_ENV} = .*missing.toml: no such file$"):
        load_site(None)
    monkeypatch.delenv(SITE_ENV)
    assert load_site(None) == Site()


@pytest.mark.parametrize("text, minutes", [("30", 30), ("1:30", 1.5), ("2:00:00", 120), ("1-0", 1440),
                                           ("1-02:30", 1590), ("0-00:02:00", 2), ("UNLIMITED", None)])
def test_slurm_time_formats(text, minutes):
    assert time_minutes(text) == minutes


# --- inside the job ---------------------------------------------------------------------------

def test_the_stop_begins_as_early_as_the_save_needs_at_most_half_the_limit():
    assert job_step.stop_offset(None, 300) == (None, None)  # no time limit: no stop of its own
    assert job_step.stop_offset(600, 300) == (360, None)  # 10 hours: the grace period + torchrun's margin
    offset, warning = job_step.stop_offset(2, 300)
    assert offset == 60 and warning.startswith("warning: the time limit (0:02:00) leaves 60 s for the stop before it, "
                                               "which needs 360 s")


@pytest.mark.parametrize("fields, signal, code, finished, trained, attempt, verdict", [
    ({"JobState": "RUNNING"}, "none", 0, True, True, 1, "finished"),
    ({"JobState": "RUNNING"}, "USR1", 0, False, True, 1, "requeue"),  # the time limit
    ({"JobState": "RUNNING", "PreemptTime": "2026-12-06T10:00:00"}, "TERM", 0, False, True, 1, "requeue"),
    ({"JobState": "RUNNING", "Restarts": "1"}, "TERM", 0, False, True, 1, "requeued by SLURM"),  # scontrol requeue
    ({"JobState": "COMPLETING"}, "TERM", 0, False, True, 1, "cancelled"),  # scancel
    ({"JobState": "RUNNING"}, "TERM", 0, False, True, 1, "stopped"),  # scancel --signal=TERM
    ({"JobState": "RUNNING"}, "none", 1, False, False, 1, "retry"),  # a start that never trained
    ({"JobState": "RUNNING"}, "none", 1, False, False, job_step.MAX_ATTEMPTS, "failed"),  # ... nor on its last try
    ({"JobState": "RUNNING"}, "none", 1, False, True, 1, "failed"),  # a failure after training: not retried
    ({"JobState": "RUNNING"}, "none", 2, False, False, 1, "failed"),  # bad input: the same again
    ({"JobState": "RUNNING"}, "USR1", 3, False, True, 1, "failed"),  # non-finite: not requeued
])
def test_the_verdict_at_each_stop(fields, signal, code, finished, trained, attempt, verdict):
    assert job_step.decide(fields, 0, signal, code, finished, trained, attempt) == verdict


def test_the_rendezvous_is_a_reachable_address_and_a_free_port_below_the_ephemeral_range(monkeypatch):
    assert job_step.head_address("10.1.2.3", None) == "10.1.2.3"  # SLURM's NodeAddr, an address
    # a name a hosts file maps to 127.0.1.1 besides the node's own address: the node's
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(0, 0, 0, "", ("127.0.1.1", 0)),
                                                                (0, 0, 0, "", ("10.0.0.5", 0))])
    assert job_step.head_address("node1", None) == "10.0.0.5"
    # only loopback: this node's address on the route to the other node
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(0, 0, 0, "", ("127.0.1.1", 0))])
    assert job_step.head_address("node1", "127.0.0.1") == "127.0.0.1"
    monkeypatch.undo()
    low = job_step.ephemeral_low()
    port = job_step.free_port()
    assert job_step.RDZV_PORT_LOW <= port < low
    with socket.socket() as held:  # a port something listens on is passed over
        held.bind(("0.0.0.0", port))
        held.listen()
        assert all(port < job_step.free_port(port, port + 16) < port + 16 for _ in range(20))
    # two jobs starting on one node at once: apart (12,768 ports from a random place)
    assert len({job_step.free_port() for _ in range(8)}) > 1


def test_the_store_is_hosted_by_the_head_node_only():
    from gamma_titan.training.torchrun import with_store_host

    assert with_store_host("", "n1", "n1") == "is_host=1"
    assert with_store_host("read_timeout=120", "n1", "n2") == "read_timeout=120,is_host=0"
    assert with_store_host("is_host=0", "n1", "n1") == "is_host=0"  # a user's own word stands
    assert with_store_host("", None, "n1") == ""  # no job script named the host: torchrun's guess


def test_after_stop_records_each_start_and_how_it_ended(tmp_path, monkeypatch, capsys):
    """The records `status` reads: a start from step 40 that the time limit stopped at 59."""
    run = tmp_path / "run"
    (run / "runs/20261206T100000Z-0").mkdir(parents=True)
    (run / "runs/20261206T100000Z-0/config.toml").write_text('[training]\nsteps = 100\n[checkpoint]\nfolder = "ckpt"\n')
    (run / "runs/20261206T100000Z-0/run.json").write_text(json.dumps({"slurm_job": "12", "slurm_restart": 1}))
    (run / "ckpt/step-40").mkdir(parents=True)
    (run / "ckpt/step-40/.metadata").write_text("x")
    metrics = [{"step": s, "loss": 1.0, "elapsed_s": s} for s in range(1, 41)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    assert job_step.start(run, 300, {"TimeLimit": "04:00:00"}) == "360"
    (run / "ckpt/step-59").mkdir()
    (run / "ckpt/step-59/.metadata").write_text("x")
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps({"step": s, "loss": 1.0, "elapsed_s": s}) + "\n" for s in range(41, 60)))
    assert job_step.after_stop(run, "USR1", 0, 1, {"JobState": "RUNNING", "Restarts": "1"}) == "requeue"
    err = capsys.readouterr().err
    assert "gamma-titan: job 12 (start 2) on n[1-2]: from step 40; time limit 4:00:00, the stop begins 360 s" in err
    assert ("gamma-titan: job 12: the time limit is near, training stopped with exit 0: requeueing it; its next "
            "start resumes from the stop's checkpoint (step 59)") in err
    begin, end = records.starts(run)
    assert (begin["event"], begin["start"], begin["checkpoint"], begin["stop_offset_s"]) == ("start", 2, 40, 360)
    assert (end["verdict"], end["checkpoint"], end["target"]) == ("requeue", 59, 100)
    from gamma_titan.slurm.status import start_lines

    assert start_lines(run, live=False) == [
        f"    1. job 12 start 2, {begin['time'][:10]} {begin['time'][11:19]}, n[1-2], from step 40: the time limit is "
        "near: checkpointed, requeued itself at step 59"]


# --- submit and status, end to end without a cluster ----------------------------------------------

def user_folder(tmp_path: Path) -> Path:
    team = tmp_path / "team"
    team.mkdir()
    (team / "my.toml").write_text(TINY.read_text().replace('"./outputs/dense-tiny"', '"./runs/mine"'))
    return team


def test_submit_dry_run_checks_the_layout_and_prints_the_script_writing_nothing(tmp_path, builtin_assets, cli):
    team = user_folder(tmp_path)
    done = cli("submit", "my.toml", "--nodes", "2", "--gpus-per-node", "4", "--account", "acme", "--time", "1:00:00",
               "--training.steps", "300", "--dry-run", cwd=team)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=4\n" in done.stdout
    assert "#SBATCH --account=acme\n" in done.stdout and "#SBATCH --time=1:00:00\n" in done.stdout
    assert "--nproc_per_node=4 " in done.stdout
    assert f"-m gamma_titan.train --job.config_file {team / 'my.toml'} --training.steps 300 &" in done.stdout
    assert f"cd {team}\n" in done.stdout and f"RUN_DIR={team / 'runs/mine'}\n" in done.stdout
    # the command that submits it again, as typed (without --dry-run)
    assert (f"export GAMMA_TITAN_LAUNCH_COMMAND='cd {team} && gamma-titan submit my.toml --nodes 2 --gpus-per-node 4 "
            "--account acme --time 1:00:00 --training.steps 300'") in done.stdout
    assert sorted(p.name for p in team.iterdir()) == ["my.toml"]  # nothing written


@pytest.mark.parametrize("argv, message", [
    (["missing.toml"], "missing.toml: no such config file"),
    (["my.toml", "--sbatch=--output=x"], "--sbatch: '--output=x': the job script sets --output itself"),
    (["my.toml", "--time", "soon"], "--time = 'soon': not a SLURM time"),
    (["my.toml", "--gpus-per-node", "8", "--nproc-per-node", "2"], "--nproc-per-node 2: a GPU node runs one rank per GPU"),
    (["my.toml", "--gpus-per-node", "0", "--nodes", "3", "--training.global_batch_size", "32"],
     "at 3 node(s) x 1 rank(s): training.global_batch_size = 32: must be -1 or a multiple of"),
    (["my.toml", "--site", "nowhere.toml"], "site file nowhere.toml: no such file"),
    (["my.toml", "--training.stepz", "3"], "training.stepz"),
    (["my.toml", "--nodes", "0"], "argument --nodes: 0: must be an integer >= 1"),
])
def test_submit_refuses_bad_input_in_one_line_before_anything_is_written(tmp_path, builtin_assets, argv, message,
                                                                          cli):
    team = user_folder(tmp_path)
    done = cli("submit", *argv, cwd=team)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert message in done.stderr, done.stderr
    assert sorted(p.name for p in team.iterdir()) == ["my.toml"]


def test_submit_without_sbatch_writes_nothing(tmp_path, builtin_assets, cli):
    team = user_folder(tmp_path)
    done = cli("submit", "my.toml", "--gpus-per-node", "0", cwd=team,
               env={"PATH": os.path.dirname(sys.executable)})
    assert done.returncode == 2 and "error: no sbatch on PATH (use --dry-run to only see the script)" in done.stderr
    assert sorted(p.name for p in team.iterdir()) == ["my.toml"]


def test_status_without_slurm_reads_the_run_folder(tmp_path, cli):
    """A run trained by `gamma-titan train` (no job), and one a job wrote records into, read
    where there is no scontrol: each says what it can."""
    run = tmp_path / "run"
    (run / "runs/20261206T100000Z-0").mkdir(parents=True)
    (run / "runs/20261206T100000Z-0/config.toml").write_text('[training]\nsteps = 50\n')
    (run / "checkpoint/step-20").mkdir(parents=True)
    (run / "checkpoint/step-20/.metadata").write_text("x")
    (run / "checkpoint/step-30").mkdir()  # a save cut short: not complete
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "elapsed_s": 2.0 * s}) + "\n"
                                               for s in range(1, 31)))
    done = cli("status", run, cwd=tmp_path, env={"PATH": os.path.dirname(sys.executable)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        str(run), "  SLURM: no job (never submitted with gamma-titan submit or recipe run --launcher slurm)",
        "  step 30 / 50 (60%), not running: 20 steps left ≈ 0:00:40 of training", "  checkpoint: step 20"]
    records.record_submission(run, "77", run / "slurm/job.sbatch", run / "slurm/job-%j.out", "x")
    done = cli("status", run, cwd=tmp_path, env={"PATH": os.path.dirname(sys.executable)})
    assert "  SLURM: job 77 (its state unknown: no scontrol here)" in done.stdout.splitlines()
    missing = cli("status", tmp_path / "nothing", cwd=tmp_path)
    assert missing.returncode == 2 and "no such folder (a run's dump folder, or a recipe's --out)" in missing.stderr
