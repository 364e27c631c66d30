"""The job scripts of `gamma-titan submit` and `gamma-titan recipe run ... --launcher slurm`
(one template, gamma_titan/slurm/script.py), on a real SLURM (tools/local_slurm.py: a
controller and two nodes on this machine): every way a run ends, read back from SLURM itself
(`scontrol show job`, the jobcomp file), from the run, and from `gamma-titan status`.

  finish                  a recipe's run: COMPLETED 0:0 at the last step
  submit                  a user's config (not a recipe) through `gamma-titan submit` on 2 nodes,
                          with --partition and --account and a site file (setup lines, an
                          environment variable, no --exclusive): its 2-minute time limit stops
                          it with a checkpoint, the job requeues itself and continues to the
                          last step, its losses bitwise those of an uninterrupted run; a second
                          submit while it runs is refused; `status` at each stage; then
                          `submit --training.steps` extends it to a new last step
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
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import REPO, read_metrics
from gamma_titan.slurm import records

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
    submit: list[str] | None = None  # `gamma-titan submit` arguments (instead of sbatch SCRIPT)
    cwd: Path | None = None  # where `gamma-titan submit` runs
    env: dict[str, str] = field(default_factory=dict)  # more of the job's environment (sbatch exports it)
    job: str = ""
    acted_at: float | None = None
    preemptor: str | None = None
    released: int = 0
    ends: list[dict] = field(default_factory=list)
    seen: dict[str, object] = field(default_factory=dict)  # what the test saw on the way (submit)

    @property
    def run_dir(self) -> Path:
        return self.script.parent.parent if self.submit else self.script.parent.parent / self.script.stem

    @property
    def log(self) -> Path:
        if self.submit:
            return self.script.with_name(f"job-{self.job}.out")
        return self.script.with_name(f"{self.script.stem}-{self.job}.out")

    def logged_steps(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        return [r["step"] for r in read_metrics(self.run_dir) if "loss" in r] if path.exists() else []


def gamma_titan(*argv: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """The real command line, as a user types it."""
    return subprocess.run([sys.executable, "-m", "gamma_titan.cli", *argv], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


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


def start_job(s: Scenario, env: dict[str, str]) -> None:
    if s.submit:
        done = gamma_titan("submit", *s.submit, env=env, cwd=s.cwd)
        assert done.returncode == 0, done.stdout + done.stderr
        s.seen["submitted"] = done.stdout
        s.job = re.search(r"^submitted job (\d+)", done.stdout, re.M).group(1)
    else:
        s.job = subprocess.run(["sbatch", "--parsable", str(s.script)], capture_output=True, text=True, check=True,
                               env={**env, "GAMMA_TITAN_TEST_STEP_SECONDS": str(s.step_seconds), **s.env}
                               ).stdout.strip().split(";")[0]


def observe(s: Scenario, fields: dict[str, str], env: dict[str, str]) -> None:
    """The submit scenario, at each stage: `status`, and a second submit while it runs."""
    if not s.submit:
        return
    state, starts_now = fields.get("JobState", ""), int(fields.get("Restarts", "0") or 0)
    if state == "RUNNING" and "running" not in s.seen and max(s.logged_steps(), default=0) >= ACT_AT_STEP:
        s.seen["fields"] = dict(fields)
        s.seen["second submit"] = gamma_titan("submit", *s.submit, env=env, cwd=s.cwd)
        s.seen["running"] = gamma_titan("status", str(s.run_dir), env=env, cwd=s.cwd).stdout
    if state == "PENDING" and fields.get("Reason") == "BeginTime" and f"requeued {starts_now}" not in s.seen:
        s.seen[f"requeued {starts_now}"] = gamma_titan("status", str(s.run_dir), env=env, cwd=s.cwd).stdout


def drive(state: Path, scenarios: list[Scenario], env: dict[str, str]) -> None:
    """Start every scenario's job, act on each once its run is under way, release requeued
    jobs, and wait until each has ended for good."""
    for s in scenarios:
        start_job(s, env)
    deadline = time.monotonic() + DEADLINE_S
    waiting = list(scenarios)
    while waiting:
        assert time.monotonic() < deadline, {s.name: job_fields(state, s.job).get("JobState") for s in waiting}
        for s in list(waiting):
            fields = job_fields(state, s.job)
            job_state = fields.get("JobState", "")
            observe(s, fields, env)
            if job_state == "PENDING" and fields.get("Reason") == "BeginTime":
                slurm(state, "scontrol", "update", f"jobid={s.job}", "starttime=now")  # requeued: no 2-minute wait
                s.released += 1
            elif job_state == "RUNNING" and s.act and s.acted_at is None and max(s.logged_steps(), default=0) >= \
                    ACT_AT_STEP:
                act(state, s)
            elif job_state in TERMINAL:
                s.ends = jobcomp(state, s.job)
                if s.submit:
                    s.seen["done"] = gamma_titan("status", str(s.run_dir), env=env, cwd=s.cwd).stdout
                waiting.remove(s)
        time.sleep(0.5)


#: The user's config of the submit scenario: configs/dense/tiny.toml at width 32, their own
#: folder and steps, a checkpoint every 20 steps, every step logged.
USER_CONFIG_EDITS = {'dump_folder = "./outputs/dense-tiny"': 'dump_folder = "./runs/mine"',
                     'flavor = "tiny-64"': 'flavor = "tiny-32"', "steps = 1000": "steps = 160",
                     "log_freq = 10": "log_freq = 1", "local_batch_size = 32\nseq_len = 128\nsteps":
                         "local_batch_size = 2\nseq_len = 64\nsteps",
                     "[validation]\nenable = true": "[validation]\nenable = false",
                     "[gamma.diagnostics]\nenable = true": "[gamma.diagnostics]\nenable = false",
                     "[metrics]\n": "[metrics]\nenable_tensorboard = false\n", "enable_tensorboard = true": "",
                     'custom_import = "gamma_titan.training.train_spec"': 'custom_import = "fault_injection"'}


def user_config(folder: Path) -> Path:
    text = (REPO / "configs/dense/tiny.toml").read_text()
    for old, new in USER_CONFIG_EDITS.items():
        assert old in text, old
        text = text.replace(old, new)
    text = text.replace("# interval: left to the recipe planner", "interval = 20\n# (was) interval: left to the recipe planner")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "my.toml").write_text(text)
    return folder / "my.toml"


def site_file(folder: Path) -> Path:
    """A site file as a team writes it: setup lines the job runs first, environment variables,
    the nodes' Python, no whole nodes."""
    path = folder / "site.toml"
    path.write_text(f"""# the local test cluster
exclusive = false
python = "{sys.executable}"
setup = ["echo \\"gamma-titan test: setup ran on $(hostname -s) for job $SLURM_JOB_ID\\"",
         "export GT_FROM_SETUP=set-up"]
[env]
GT_SITE_VAR = "from-the-site"
GAMMA_TITAN_TEST_ECHO_ENV = "GT_SITE_VAR,GT_FROM_SETUP"
GAMMA_TITAN_TEST_STEP_SECONDS = 0.5
PYTHONPATH = "{os.pathsep.join([str(REPO / 'tests' / 'scripts'), os.environ.get('PYTHONPATH', '')])}"
OMP_NUM_THREADS = 1
""")
    return path


@pytest.fixture(scope="module")
def ended(cluster, tmp_path_factory, builtin_assets):
    """Every scenario, run to its end on the cluster; name -> Scenario."""
    root = tmp_path_factory.mktemp("slurm_runs")
    team = root / "team"
    user_config(team)
    site = site_file(team)
    submit = ["my.toml", "--nodes", "2", "--gpus-per-node", "0", "--partition", "low", "--account", "acme",
              "--time", "2", "--site", str(site)]
    scenarios = [
        Scenario("finish", write_script(root / "finish", steps=12), 12),
        # its first attempt exits 1 before training, as a start that cannot reach its store does
        Scenario("a failed start", write_script(root / "flaky", steps=12), 12,
                 env={"GAMMA_TITAN_TEST_FAIL_STARTS": f"1:{root / 'flaky' / 'failed'}"}),
        # 80 s of steps: more than a first start has before its stop at ~60 s
        Scenario("submit", team / "runs/mine/slurm/job.sbatch", 160, submit=submit, cwd=team, step_seconds=0.5),
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
    scenarios[2].seen["starts"] = starts(scenarios[2])  # before the extension trains on in the same folder
    # the submit scenario, extended: the same command with a larger --training.steps
    extended = Scenario("submit, extended", scenarios[2].script, 200, submit=[*submit, "--training.steps", "200"],
                        cwd=team, step_seconds=0.5)
    drive(cluster, [extended], env)
    return {s.name: s for s in [*scenarios, extended]}


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
    resume hint names the kept script (a recipe's; submit's: the submit command), not
    SLURM's spool copy of it; each start's verdict is the last line of the start, none but
    the rendezvous port below the ephemeral range."""
    text = s.log.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]
    assert text.count("Training completed") == (s.steps in s.logged_steps()), text[-4000:]
    hint = f"cd {s.cwd} && gamma-titan submit {shlex.join(s.submit)}" if s.submit else f"sbatch {s.script}"
    assert hint in text and "/var/spool" not in text, text[-3000:]
    for start in re.split(r"^gamma-titan: job \d+ \(start \d+\) on .*$", text, flags=re.M)[1:]:
        # nothing after the verdict but SLURM's own requeue words: no "TERM to the job script" once training ended
        after = re.split(r"^gamma-titan: job \d+: (?:finished|cancelled|requeued by SLURM|stopped|.*requeueing it)",
                         start, flags=re.M)
        assert len(after) == 2 and "to the job script: every rank" not in after[1], start[-2000:]
    ports = [int(p) for p in re.findall(r"^gamma-titan: job \d+: rendezvous \S+ at [\d.]+:(\d+) ", text, re.M)]
    assert ports and all(20000 <= p < 32768 for p in ports), ports
    return text


def check_resumed_at_the_stop(s: Scenario, parts: list[list[int]] | None = None) -> list[list[int]]:
    """Each start after the first begins right after the step the one before checkpointed;
    no step is trained twice, none is skipped; the run ends at its last step. (`parts`: the
    starts as they were at the scenario's end, before another job trained on.)"""
    parts = starts(s) if parts is None else parts
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


def test_a_start_that_fails_before_training_is_tried_again_with_a_new_rendezvous(ended):
    s = ended["a failed start"]
    assert [(e["JobState"], e["ExitCode"]) for e in s.ends] == [("COMPLETED", "0:0")]  # one job, one SLURM start
    assert starts(s) == [list(range(1, s.steps + 1))]
    text = check_common(s)
    assert text.count("fault_injection: failing start 1 of rank 0") == 1
    assert (f"job {s.job}: training ended with exit 1 before it trained a step (attempt 1 of 3): starting it again "
            "with a new rendezvous") in text
    assert [m for m in re.findall(rf"rendezvous ({s.job}\.\d\.\d)\.\d+ at", text)] == [f"{s.job}.0.1", f"{s.job}.0.2"]
    assert f"job {s.job}: finished" in text
    verdicts = [(r["attempt"], r["verdict"]) for r in records.starts(s.run_dir) if r["event"] == "end"]
    assert verdicts == [(1, "retry"), (2, "finished")]


def test_a_user_config_submitted_to_two_nodes_stops_at_its_time_limit_requeues_and_finishes(ended):
    """`gamma-titan submit my.toml --nodes 2 --partition low --account acme --time 2 --site
    site.toml`: what SLURM was asked, every start of the job and how it ended, the losses of
    an uninterrupted run, bit for bit."""
    s = ended["submit"]
    assert s.ends[-1]["JobState"] == "COMPLETED" and s.ends[-1]["ExitCode"] == "0:0", s.ends
    # what SLURM was asked (scontrol show job while it ran) and what the script says
    fields = s.seen["fields"]
    assert (fields["Partition"], fields["Account"], fields["NumNodes"]) == ("low", "acme", "2"), fields
    assert fields["TimeLimit"] == "00:02:00" and fields["JobName"] == "gt-mine", fields
    script = s.script.read_text()
    assert "#SBATCH --partition=low\n" in script and "#SBATCH --account=acme\n" in script
    assert "#SBATCH --time=2\n" in script and "--exclusive" not in script  # the site file's exclusive = false
    assert "#SBATCH --gpus-per-node" not in script and "--nproc_per_node=1 " in script  # CPU nodes
    parts = check_resumed_at_the_stop(s, s.seen["starts"])
    text = check_common(s)
    starts_text = re.split(rf"^gamma-titan: job {s.job} \(start \d+\) on .*$", text, flags=re.M)[1:]
    assert len(starts_text) == len(parts), text[-3000:]
    # the time limit: the job stopped its training 60 s before the 2-minute limit (at most half of
    # it, which the start line warns about), checkpointed, and requeued itself
    assert text.count("time limit 0:02:00, the stop begins 60 s before it") == len(parts)
    assert "warning: the time limit (0:02:00) leaves 60 s for the stop before it, which needs 360 s" in text
    for start in starts_text[:-1]:
        assert start.count("USR1 to the job script") == 1, start[-3000:]
        assert start.count("the time limit is near, training stopped with exit 0: requeueing it") == 1, start[-3000:]
    assert f"job {s.job}: finished" in starts_text[-1] and "requeueing it" not in starts_text[-1]
    # the site file: its setup lines ran before training, its environment reached every rank
    assert text.count("gamma-titan test: setup ran on") == len(parts)
    for rank in (0, 1):
        assert f"fault_injection: rank {rank} env GT_SITE_VAR=from-the-site" in text
        assert f"fault_injection: rank {rank} env GT_FROM_SETUP=set-up" in text
    # the same steps as one uninterrupted run on the same layout, to the bit
    reference = s.cwd / "reference"
    done = gamma_titan("train", "my.toml", "--nproc", "2", "--job.dump_folder", str(reference),
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests/scripts"),
                                                                       os.environ.get("PYTHONPATH", "")])},
                       cwd=s.cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = {r["step"]: r["loss"] for r in read_metrics(s.run_dir) if "loss" in r and r["step"] <= 160}
    theirs = {r["step"]: r["loss"] for r in read_metrics(reference) if "loss" in r}
    assert sorted(ours) == list(range(1, 161)) and ours == theirs


def test_submit_refuses_a_second_job_and_status_says_where_the_run_stands(ended):
    s = ended["submit"]
    # submitted: the lines a user reads
    assert f"submitted job {s.job}: 2 node(s) x 1 rank(s), partition low, account acme, time limit 2" in \
        s.seen["submitted"]
    assert f"stop for good (a checkpoint, then COMPLETED): scancel --signal=TERM {s.job}" in s.seen["submitted"]
    # a second submit while the job runs: one line naming it, nothing submitted
    second = s.seen["second submit"]
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert second.stderr == (f"error: {s.run_dir}: job {s.job} of this run is RUNNING; wait for it, stop it "
                             f"(scancel --signal=TERM {s.job}), or add --force to submit another\n")
    # status while it ran, while it waited after the time limit, and at the end
    running = s.seen["running"]
    assert f"SLURM: job {s.job} RUNNING on n[1-2]" in running and "(start 1)" in running, running
    assert re.search(r"step \d+ / 160 \(\d+%\), ETA \d+:\d\d:\d\d", running), running
    assert re.search(rf"1\. job {s.job} start 1, .*, n\[1-2\], from the start: running", running), running
    requeued = s.seen["requeued 1"]
    assert f"SLURM: job {s.job} PENDING (BeginTime)" in requeued, requeued
    first_end = s.seen["starts"][0][-1]
    assert f"start 1, " in requeued and ("the time limit is near: checkpointed, requeued itself at step "
                                          f"{first_end}") in requeued, requeued
    assert f"checkpoint: step {first_end}" in requeued
    done = s.seen["done"]
    assert f"SLURM: not queued (job {s.job}: COMPLETED)" in done and "step 160 / 160 (100%), done" in done, done
    assert re.search(rf"start \d, .*from step \d+: finished at step 160", done), done


def test_submit_with_more_steps_extends_the_run(ended):
    s = ended["submit, extended"]
    assert s.job != ended["submit"].job
    assert s.ends[-1]["JobState"] == "COMPLETED" and s.ends[-1]["ExitCode"] == "0:0", s.ends
    parts = starts(s)
    assert parts[-1][0] == 161 and parts[-1][-1] == 200 and 200 in complete_checkpoints(s), parts
    text = s.log.read_text()
    assert "resuming step-160 with training.steps 200 (the last run had 160)" in text, text[-3000:]
    assert f"job {s.job}: finished: {s.run_dir} reached step 200" in text
    assert "step 200 / 200 (100%), done" in s.seen["done"]
    # one script, rewritten: the steps live in the trainer's command (and its run record); the
    # verdict after each stop reads them from there, not from a copy in the script
    script = s.script.read_text()
    assert "--training.steps 200 &\n" in script
    assert re.search(r'helper after-stop "\$RUN_DIR" "\$stop" "\$code" "\$attempt"\)\n', script)


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
    assert f"job {s.job}: requeued by SLURM (scontrol requeue): its next start resumes" in text  # the verdict


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


def test_a_recipe_submits_one_job_per_unfinished_run(ended, cluster, tmp_path, monkeypatch, capsys):
    """`recipe run --launcher slurm` through the real sbatch, with the site settings submit
    takes: one job per run, their ids in OUT/slurm/jobs.json and each run's records; `status
    OUT` lists them; a rerun submits only the runs neither finished nor queued. (After the
    scenarios: the jobs are cancelled before they start training.)"""
    from gamma_titan.recipes.run import run_recipe
    from gamma_titan.slurm.site import Site
    from gamma_titan.slurm.status import status

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
    site = Site(account="acme", sbatch=("--comment=recipe",))
    slurm(cluster, "scontrol", "update", "partitionname=low", "state=DOWN")  # held: nothing starts
    try:
        assert run_recipe(str(recipe), "tiny", launcher="slurm", out=str(out), steps=8, site=site) == 0
        jobs = json.loads((out / "slurm" / "jobs.json").read_text())
        assert sorted(jobs) == ["g0.5_s0", "g1_s0"]
        for name, job in jobs.items():
            fields = job_fields(cluster, job)
            assert fields["JobState"] == "PENDING" and fields["JobName"] == f"gt-two-{name}", fields
            assert fields["Command"] == str((out / "slurm" / f"{name}.sbatch").resolve())
            assert fields["Account"] == "acme" and fields["Comment"] == "recipe", fields
            assert [r["job"] for r in records.jobs(out / name)] == [job]
        capsys.readouterr()
        assert status(str(out)) == 0
        printed = capsys.readouterr().out
        assert printed.startswith(f"{out.resolve()}: recipe two, 2 runs\n"), printed
        for name, job in jobs.items():
            assert f"{(out / name).resolve()}\n  SLURM: job {job} PENDING (PartitionDown) (start 1)\n" in printed, printed
        finished = out / "g1_s0"  # one run done, the other queued: a rerun submits neither
        (finished / "metrics.jsonl").write_text(json.dumps({"step": 8, "loss": 2.0}) + "\n")
        assert run_recipe(str(recipe), "tiny", launcher="slurm", out=str(out), steps=8, site=site) == 0
        assert f"g0.5_s0: job {jobs['g0.5_s0']} is PENDING: not submitted again" in capsys.readouterr().out
        assert json.loads((out / "slurm" / "jobs.json").read_text()) == jobs
        slurm(cluster, "scancel", jobs["g0.5_s0"])  # its job gone: the rerun submits it again
        assert run_recipe(str(recipe), "tiny", launcher="slurm", out=str(out), steps=8, site=site) == 0
        again = json.loads((out / "slurm" / "jobs.json").read_text())
        assert again["g1_s0"] == jobs["g1_s0"] and again["g0.5_s0"] != jobs["g0.5_s0"]
    finally:
        slurm(cluster, "scancel", "--partition=low", "--state=PENDING", check=False)
        slurm(cluster, "scontrol", "update", "partitionname=low", "state=UP")
