"""A recipe's runs as SLURM jobs: one job per run, through the job script `gamma-titan
submit` writes (gamma_titan/slurm/script.py), with the same site settings and the same
verdicts at every stop (gamma_titan/slurm/job.py).

What a recipe adds: the job's time limit, 1.5 x the run's GPU-hours estimate spread over its
GPUs (at least an hour), unless the scale, the site file or --time sets one; nodes and GPUs
per node from the run (a CPU scale asks for no GPU). Scripts go to OUT/slurm/NAME.sbatch,
each job's log to OUT/slurm/NAME-JOBID.out (appended across requeues), the job ids to
OUT/slurm/jobs.json and to each run's own slurm/jobs.jsonl (what `gamma-titan status` reads).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from gamma_titan.recipes.plan import PlannedRun
from gamma_titan.recipes.spec import CPU_SCALES, Scale
from gamma_titan.slurm import records, scheduler
from gamma_titan.slurm.script import JobSpec, write_script
from gamma_titan.slurm.site import Site
from gamma_titan.training.launch import save_seconds


def time_limit_minutes(run: PlannedRun, scale: Scale) -> int:
    """1.5 × the GPU-hours estimate spread over the job's GPUs, at least an hour."""
    hours = scale.time_limit_hours or max(1.0, 1.5 * run.gpu_hours / run.world_size)
    return math.ceil(hours * 60)


def _slurm_time(minutes: int) -> str:
    return f"{minutes // 1440}-{minutes % 1440 // 60:02d}:{minutes % 60:02d}:00"


def job_of(run: PlannedRun, scale: Scale, out: Path, recipe: str) -> JobSpec:
    script = (out / "slurm" / f"{run.name}.sbatch").resolve()
    return JobSpec(
        name=f"gt-{recipe}-{run.name}", run_dir=(out / run.name).resolve(), train_argv=run.argv((out / run.name).resolve()),
        nodes=run.nodes, ranks_per_node=run.gpus_per_node,
        gpus_per_node=0 if scale.name in CPU_SCALES else run.gpus_per_node, grace_seconds=run.stop_grace_seconds,
        script=script, log=script.with_name(f"{run.name}-%j.out"), workdir=Path.cwd(),
        launch_command=f"sbatch {script}",
        about=[f"gamma-titan recipe {recipe}, scale {scale.name}, run {run.name}: {run.steps} steps, "
               f"{run.tokens / 1e9:.4g}B tokens, ≈ {run.gpu_hours:.4g} GPU-hours; a full save ≈ "
               f"{save_seconds(run.params, run.nodes):.0f} s within the {run.stop_grace_seconds:g} s grace period"])


def write_scripts(runs: list[PlannedRun], scale: Scale, out: Path, recipe: str, site: Site) -> dict[str, JobSpec]:
    jobs = {}
    for run in runs:
        job = job_of(run, scale, out, recipe)
        timed = site if site.time else replace(site, time=_slurm_time(time_limit_minutes(run, scale)))
        write_script(job, timed)
        jobs[run.name] = job
    return jobs


def submit(jobs: dict[str, JobSpec]) -> dict[str, str]:
    """sbatch each job's script, unless a job of that run is pending or running already;
    run name -> job id (or why not)."""
    from gamma_titan.errors import ConfigError

    submitted = {}
    for name, job in jobs.items():
        live = scheduler.queued([r["job"] for r in records.jobs(job.run_dir) if r.get("job")], job.script)
        if live:
            submitted[name] = live[-1][0]
            print(f"  {name}: job {live[-1][0]} is {live[-1][1]}: not submitted again", flush=True)
            continue
        try:
            submitted[name] = scheduler.sbatch(job.script)
        except ConfigError as e:
            submitted[name] = f"failed: {e}"
            print(f"  {name}: sbatch FAILED: {e}", flush=True)
            continue
        records.record_submission(job.run_dir, submitted[name], job.script, job.log, job.launch_command)
        print(f"  {name}: submitted job {submitted[name]}", flush=True)
    return submitted
