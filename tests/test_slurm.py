"""The sbatch scripts `gamma-titan recipe run ... --launcher slurm` writes, on a real SLURM
(tools/local_slurm.py: a controller and two nodes on this machine): every way a run ends,
read back from SLURM itself (`scontrol show job`, the jobcomp file) and from the run.

  finish                  COMPLETED 0:0 at the last step
  time limit              SIGUSR1 before the limit (2 minutes): a checkpoint, the job requeues
                          itself and continues to the last step
  preemption (2 nodes)    a job of the `high` partition takes both nodes: a checkpoint (the same
                          step on both nodes), the job requeues itself, resumes at that step
  scontrol requeue        an administrator's requeue: a checkpoint, SLURM requeues, it resumes
  scancel                 a checkpoint within KillWait, CANCELLED, stays stopped
  scancel --signal=TERM   plain, -b and --full: a checkpoint, COMPLETED 0:0, stays stopped

A requeued job waits 2 minutes before SLURM starts it again; the test releases it at once
(`scontrol update jobid=J starttime=now`), which is the only thing it does that no
scheduler would. Steps take at least 0.2 s (tests/scripts/fault_injection.py), so that a
run is still training when the test acts on it.

Without SLURM (not root, no package) the module is skipped with one line; with
GAMMA_TITAN_REQUIRE_SLURM=1 (CI sets it) that is a failure instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import REPO, read_metrics

sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests" / "scripts"))  # the runs' custom_import (fault_injection), which planning checks

import local_slurm  # noqa: E402

pytestmark = pytest.mark.multiprocess

REQUIRE_ENV = "GAMMA_TITAN_REQUIRE_SLURM"
STEP_SECONDS = 0.2
ACT_AT_STEP = 5  # the test acts once the run logged this step
#: A whole scenario set's limit (they run two at a time on the two nodes).
DEADLINE_S = 900
TERMINAL = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    try:
        local_slurm.up(state)
    except local_slurm.Unavailable as e:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"SLURM is required here ({REQUIRE_ENV}=1) but cannot be had: {e}")
        pytest.skip(f"no SLURM on this machine: {e}")
    yield state
    local_slurm.down(state)


def slurm(state: Path, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), env=local_slurm.environment(state), capture_output=True, text=True, check=check)


def job_fields(state: Path, job: str) -> dict[str, str]:
    done = slurm(state, "scontrol", "show", "job", job, check=False)
    return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}


def jobcomp(state: Path, job: str) -> list[dict[str, str]]:
    """Every end of `job` SLURM recorded (one per start), oldest first."""
    lines = (state / "jobcomp.txt").read_text().splitlines()
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in lines if f"JobId={job} " in line]


# --- the scripts ------------------------------------------------------------------------------

def write_script(out: Path, steps: int, nodes: int = 1, minutes: int | None = None) -> Path:
    """One run's sbatch script, as `recipe run --launcher slurm --dry-run` writes it, for a
    width-32 model whose steps log one by one."""
    from gamma_titan.recipes.run import run_recipe

    recipe = out.with_suffix(".toml")
    limit = f"time_limit_hours = {minutes / 60!r}\n" if minutes else ""
    recipe.write_text(f"""[recipe]
title = "SLURM lifecycle"
[grid]
"gamma.init_rate" = [1.0]
[set]
"experimental.custom_import" = "fault_injection"
"metrics.log_freq" = 1
"metrics.enable_tensorboard" = false
"validation.enable" = false
"gamma.diagnostics.enable" = false
"training.local_batch_size" = 2
"training.seq_len" = 64
[scale.tiny]
tokens_per_param = 1
seeds = [0]
{limit}models = [{{ config = "{REPO / 'configs/dense/tiny.toml'}", flavor = "tiny-32", nodes = {nodes} }}]
""")
    assert run_recipe(str(recipe), "tiny", launcher="slurm", dry_run=True, out=str(out), steps=steps) == 0
    (script,) = (out / "slurm").glob("*.sbatch")
    return script


@dataclass
class Scenario:
    name: str
    script: Path
    steps: int
    act: str | None = None  # what the test does at ACT_AT_STEP: scancel [flags], requeue, preempt
    step_seconds: float = STEP_SECONDS
    job: str = ""
    acted_at: float | None = None
    preemptor: str | None = None
    released: int = 0
    ends: list[dict] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.script.parent.parent / self.script.stem

    @property
    def log(self) -> Path:
        return self.script.with_name(f"{self.script.stem}-{self.job}.out")

    def logged_steps(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        return [r["step"] for r in read_metrics(self.run_dir) if "loss" in r] if path.exists() else []


def act(state: Path, s: Scenario) -> None:
    if s.act == "requeue":
        slurm(state, "scontrol", "requeue", s.job)
    elif s.act == "preempt":
        nodes = job_fields(state, s.job)["NumNodes"]
        s.preemptor = slurm(state, "sbatch", "--parsable", "-p", "high", f"--nodes={nodes}", "--exclusive",
                            f"--output={s.script.parent / 'preemptor-%j.out'}", "--wrap", "sleep 1").stdout.strip()
    else:
        slurm(state, *s.act.split(), s.job)
    s.acted_at = time.monotonic()


def drive(state: Path, scenarios: list[Scenario], env: dict[str, str]) -> None:
    """Submit every scenario's script with sbatch, act on each once its run is under way,
    release requeued jobs, and wait until each has ended for good."""
    for s in scenarios:
        s.job = subprocess.run(["sbatch", "--parsable", str(s.script)], capture_output=True, text=True, check=True,
                               env={**env, "GAMMA_TITAN_TEST_STEP_SECONDS": str(s.step_seconds)}
                               ).stdout.strip().split(";")[0]
    deadline = time.monotonic() + DEADLINE_S
    waiting = list(scenarios)
    while waiting:
        assert time.monotonic() < deadline, {s.name: job_fields(state, s.job).get("JobState") for s in waiting}
        for s in list(waiting):
            fields = job_fields(state, s.job)
            job_state = fields.get("JobState", "")
            if job_state == "PENDING" and fields.get("Reason") == "BeginTime":
                slurm(state, "scontrol", "update", f"jobid={s.job}", "starttime=now")  # requeued: no 2-minute wait
                s.released += 1
            elif job_state == "RUNNING" and s.act and s.acted_at is None and max(s.logged_steps(), default=0) >= \
                    ACT_AT_STEP:
                act(state, s)
            elif job_state in TERMINAL:
                s.ends = jobcomp(state, s.job)
                waiting.remove(s)
        time.sleep(0.5)


@pytest.fixture(scope="module")
def ended(cluster, tmp_path_factory, builtin_assets):
    """Every scenario, run to its end on the cluster; name -> Scenario."""
    root = tmp_path_factory.mktemp("slurm_runs")
    scenarios = [
        Scenario("finish", write_script(root / "finish", steps=12), 12),
        # 80 s of steps: more than a first start has before SIGUSR1 at ~57 s
        Scenario("time limit", write_script(root / "time_limit", steps=160, minutes=2), 160, step_seconds=0.5),
        Scenario("preemption, 2 nodes", write_script(root / "preempt", steps=40, nodes=2), 40, "preempt"),
        Scenario("scontrol requeue", write_script(root / "requeue", steps=40), 40, "requeue"),
        Scenario("scancel", write_script(root / "scancel", steps=400), 400, "scancel"),
        Scenario("scancel --signal=TERM", write_script(root / "term", steps=400), 400, "scancel --signal=TERM"),
        Scenario("scancel --signal=TERM -b", write_script(root / "term_b", steps=400), 400, "scancel --signal=TERM -b"),
        Scenario("scancel --signal=TERM --full", write_script(root / "term_full", steps=400), 400,
                 "scancel --signal=TERM --full"),
    ]
    path = os.pathsep.join(filter(None, [str(REPO / "tests" / "scripts"), os.environ.get("PYTHONPATH")]))
    env = {**local_slurm.environment(cluster), "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    drive(cluster, scenarios, env)
    print(f"\n{len(scenarios)} SLURM scenarios in {time.monotonic() - started:.0f} s")
    print(table(scenarios))
    return {s.name: s for s in scenarios}


# --- what each end must look like ---------------------------------------------------------------

def starts(s: Scenario) -> list[list[int]]:
    """The steps each start of the run logged: every start appends to metrics.jsonl, and its
    elapsed time begins again from 0."""
    path = s.run_dir / "metrics.jsonl"
    records = [r for r in read_metrics(s.run_dir) if "loss" in r] if path.exists() else []
    parts = []
    for i, r in enumerate(records):
        if i == 0 or r["elapsed_s"] < records[i - 1]["elapsed_s"]:
            parts.append([])
        parts[-1].append(r["step"])
    return parts


def complete_checkpoints(s: Scenario) -> list[int]:
    from gamma_titan.training.checkpoint_folders import checkpoint_steps

    return checkpoint_steps(s.run_dir / "checkpoint")[0]


def table(scenarios: list[Scenario]) -> str:
    rows = ["| case | job state, exit | starts | checkpoint steps | steps lost | resumed at | traceback |",
            "|---|---|---|---|---|---|---|"]
    for s in scenarios:
        end = s.ends[-1] if s.ends else {}
        parts = starts(s)
        resumed = ", ".join(str(p[0]) for p in parts[1:]) or "-"
        lost = sum(max(0, p[-1] - q[0] + 1) for p, q in zip(parts, parts[1:]))  # steps trained twice
        text = s.log.read_text(errors="replace") if s.job and s.log.exists() else ""
        rows.append(f"| {s.name} | {end.get('JobState')} {end.get('ExitCode')} | {len(parts)} | "
                    f"{complete_checkpoints(s)} | {lost} | {resumed} | {'yes' if 'Traceback' in text else 'no'} |")
    return "\n".join(rows)


def check_common(s: Scenario) -> str:
    """No traceback; "Training completed" only where a start reached the last step; the
    resume hint names the kept script, not SLURM's spool copy of it."""
    text = s.log.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]
    assert text.count("Training completed") == (s.steps in s.logged_steps()), text[-4000:]
    assert f"sbatch {s.script}" in text and "/var/spool" not in text, text[-3000:]
    return text


def check_resumed_at_the_stop(s: Scenario) -> list[list[int]]:
    """Each start after the first begins right after the step the one before checkpointed;
    no step is trained twice, none is skipped; the run ends at its last step."""
    parts = starts(s)
    assert len(parts) >= 2, parts
    for before, after in zip(parts, parts[1:]):
        assert after[0] == before[-1] + 1, parts
    assert parts[-1][-1] == s.steps and s.steps in complete_checkpoints(s)
    return parts


@pytest.mark.parametrize("name", ["finish"])
def test_a_finished_run_is_completed(ended, name):
    s = ended[name]
    assert [(e["JobState"], e["ExitCode"]) for e in s.ends] == [("COMPLETED", "0:0")]
    assert starts(s) == [list(range(1, s.steps + 1))] and complete_checkpoints(s) == [s.steps]
    text = check_common(s)
    assert f"job {s.job}: finished" in text and "Training completed" in text


def test_the_time_limit_checkpoints_requeues_and_continues_to_the_last_step(ended):
    s = ended["time limit"]
    assert s.ends[-1]["JobState"] == "COMPLETED" and s.ends[-1]["ExitCode"] == "0:0", s.ends
    parts = check_resumed_at_the_stop(s)
    text = check_common(s)
    starts = re.split(rf"^gamma-titan: job {s.job} \(start \d+\) on .*$", text, flags=re.M)[1:]
    assert len(starts) == len(parts), text[-3000:]
    # each start the time limit stopped: its USR1, and the job requeueing itself
    for start in starts[:-1]:
        assert start.count("USR1 to the job script") == 1, start[-3000:]
        assert start.count("the time limit is near, training stopped with exit 0: requeueing it") == 1, start[-3000:]
    # the last start may get its USR1 too, once its last step is done (a loaded machine reaches
    # the signal's offset while the run wraps up): harmless, the run is finished and not requeued
    assert starts[-1].count("USR1 to the job script") <= 1 and "requeueing it" not in starts[-1], starts[-1][-3000:]
    assert f"job {s.job}: finished" in starts[-1]
    assert "warning: the time limit (2 min) leaves 60 s for the stop" in s.script.read_text()


def test_a_preempted_two_node_job_checkpoints_on_both_nodes_and_requeues_itself(ended, cluster):
    s = ended["preemption, 2 nodes"]
    assert s.ends[-1]["JobState"] == "COMPLETED" and s.ends[-1]["ExitCode"] == "0:0", s.ends
    first = check_resumed_at_the_stop(s)[0]
    text = check_common(s)
    # every node checkpointed the same step, each saying so (srun's label: the node)
    for node in (0, 1):
        assert f"{node}: gamma-titan: SIGTERM: every worker of this node checkpointed step {first[-1]}" in text, \
            text[-4000:]
    assert "preempted, training stopped with exit 0: requeueing it" in text
    # the nodes told apart: srun's label (0:, 1:) and the rank torchrun's rendezvous gave each
    # (the rendezvous may pair them the other way round at the next start)
    first_start = text.split(f"gamma-titan: job {s.job} (start 2)")[0]
    assert {m for m in re.findall(r"^([01]): \[rank([01])\|local0\]:", first_start, re.M)} in (
        {("0", "0"), ("1", "1")}, {("0", "1"), ("1", "0")}), first_start[-3000:]
    assert [e["JobState"] for e in jobcomp(cluster, s.preemptor)] == ["COMPLETED"]  # the job that preempted it


def test_an_administrators_requeue_checkpoints_and_resumes(ended):
    s = ended["scontrol requeue"]
    assert s.ends[-1]["JobState"] == "COMPLETED" and s.ends[-1]["ExitCode"] == "0:0", s.ends
    check_resumed_at_the_stop(s)
    text = check_common(s)
    assert "CANCELLED AT" in text and "DUE TO JOB REQUEUE" in text  # SLURM's own words
    assert text.count("Loading the checkpoint from") == 1, text[-3000:]


@pytest.mark.parametrize("name, state", [("scancel", "CANCELLED"), ("scancel --signal=TERM", "COMPLETED"),
                                         ("scancel --signal=TERM -b", "COMPLETED"),
                                         ("scancel --signal=TERM --full", "COMPLETED")])
def test_a_persons_stop_checkpoints_and_stays_stopped(ended, name, state):
    s = ended[name]
    assert len(s.ends) == 1 and s.ends[0]["JobState"] == state, s.ends
    assert s.ends[0]["ExitCode"] == "0:0" or state == "CANCELLED", s.ends
    (steps,) = starts(s)
    assert ACT_AT_STEP <= steps[-1] < s.steps and complete_checkpoints(s) == [steps[-1]]  # no step lost
    text = check_common(s)
    assert f"SIGTERM: checkpointed step {steps[-1]}" in text
    assert ("cancelled (scancel): stays stopped" if state == "CANCELLED" else "stays stopped") in text, text[-3000:]


def test_a_recipe_submits_one_job_per_unfinished_run(ended, cluster, tmp_path, monkeypatch):
    """`recipe run --launcher slurm` through the real sbatch: one job per run, their ids in
    OUT/slurm/jobs.json; a rerun after one run finished submits only the others. (After the
    scenarios: the jobs are cancelled before they start training.)"""
    from gamma_titan.recipes.run import run_recipe

    monkeypatch.setenv("SLURM_CONF", local_slurm.environment(cluster)["SLURM_CONF"])
    recipe = tmp_path / "two.toml"
    recipe.write_text(f"""[recipe]
title = "two runs"
[grid]
"gamma.init_rate" = [0.5, 1.0]
[scale.tiny]
tokens_per_param = 1
seeds = [0]
models = [{{ config = "{REPO / 'configs/dense/tiny.toml'}", flavor = "tiny-32" }}]
""")
    out = tmp_path / "out"
    slurm(cluster, "scontrol", "update", "partitionname=low", "state=DOWN")  # held: nothing starts
    try:
        assert run_recipe(str(recipe), "tiny", launcher="slurm", out=str(out), steps=8) == 0
        jobs = json.loads((out / "slurm" / "jobs.json").read_text())
        assert sorted(jobs) == ["g0.5_s0", "g1_s0"]
        for name, job in jobs.items():
            fields = job_fields(cluster, job)
            assert fields["JobState"] == "PENDING" and fields["JobName"] == f"gt-two-{name}", fields
            assert fields["Command"] == str((out / "slurm" / f"{name}.sbatch").resolve())
        finished = out / "g1_s0"  # one run done: a rerun submits the other only
        finished.mkdir()
        (finished / "metrics.jsonl").write_text(json.dumps({"step": 8, "loss": 2.0}) + "\n")
        assert run_recipe(str(recipe), "tiny", launcher="slurm", out=str(out), steps=8) == 0
        again = json.loads((out / "slurm" / "jobs.json").read_text())
        assert again["g1_s0"] == jobs["g1_s0"] and again["g0.5_s0"] != jobs["g0.5_s0"]
    finally:
        slurm(cluster, "scancel", "--partition=low", "--state=PENDING", check=False)
        slurm(cluster, "scontrol", "update", "partitionname=low", "state=UP")
