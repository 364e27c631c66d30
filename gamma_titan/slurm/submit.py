"""`gamma-titan submit CONFIG.toml [--nodes N] [--gpus-per-node G] [--time LIMIT] ... [--section.key value ...]`:
one config as one SLURM job that runs until the run is done.

Everything is checked before anything is written or submitted: the site file and flags
(site.py), the config at N nodes x G ranks (pre-flight, with GPUs where the nodes have them),
and that no job of this run is pending or running (`--force` submits anyway). Then the job
script goes to `<dump_folder>/slurm/job.sbatch` (rewritten at every submit), the job is
submitted, and its id recorded in `<dump_folder>/slurm/jobs.jsonl`.

The run's length lives in one place, the config and its overrides: submitting the same
folder again with a larger `--training.steps` extends the run (the job resumes from its
newest checkpoint and trains on); the job's own verdict reads the target from the run record
its trainer wrote, never from a copy in the script.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from gamma_titan.errors import ConfigError
from gamma_titan.slurm import records, scheduler
from gamma_titan.slurm.script import JobSpec, job_script, write_script
from gamma_titan.slurm.site import Site, load_site

SCRIPT_NAME = "job.sbatch"
#: GPUs a node holds when neither the flag nor the site file says: an 8-GPU node.
DEFAULT_GPUS_PER_NODE = 8


@dataclass
class Request:
    """What `submit` was asked: the config, its overrides, the flags."""

    config: str
    overrides: list[str]
    nodes: int = 1
    gpus_per_node: int | None = None
    nproc_per_node: int | None = None
    site_file: str | None = None
    flags: dict | None = None  # partition, account, qos, constraint, time, sbatch (None: not given)
    dry_run: bool = False
    force: bool = False


def job_name(dump: Path) -> str:
    return f"gt-{dump.name}"


#: Flags of one submit that are not part of the job (the command that submits it again leaves them out).
ONE_OFF_FLAGS = ("--dry-run", "--force")


def submit_command(argv: list[str]) -> str:
    """The command that submits this job again from anywhere: `cd` where it was submitted."""
    kept = [a for a in argv if a not in ONE_OFF_FLAGS]
    return f"cd {shlex.quote(os.getcwd())} && gamma-titan submit {shlex.join(kept)}"


def plan_job(request: Request, argv: list[str]) -> tuple[JobSpec, Site, object]:
    """Every check; the job, its site settings and the checked config."""
    from gamma_titan.config import load_job_config
    from gamma_titan.training.preflight import preflight

    site = load_site(request.site_file).merged(**(request.flags or {}), gpus_per_node=request.gpus_per_node)
    gpus = site.gpus_per_node if site.gpus_per_node is not None else DEFAULT_GPUS_PER_NODE
    ranks = request.nproc_per_node or gpus or 1
    if gpus and ranks != gpus:
        raise ConfigError(f"--nproc-per-node {ranks}: a GPU node runs one rank per GPU ({gpus}); it is for CPU nodes "
                          "(--gpus-per-node 0)")
    if not Path(request.config).is_file():
        raise ConfigError(f"{request.config}: no such config file")
    config_path = Path(request.config).resolve()
    train_argv = ["--job.config_file", str(config_path), *request.overrides]
    config = load_job_config(train_argv)
    world = request.nodes * ranks
    try:
        preflight(config, world_size=world, local_world_size=ranks, cuda=bool(gpus))
    except ConfigError as e:
        raise ConfigError(f"at {request.nodes} node(s) x {ranks} rank(s): {e}") from None
    dump = Path(config.job.dump_folder).resolve()
    script = dump / records.SLURM_FOLDER / SCRIPT_NAME
    time_line = f"time limit {site.time}" if site.time else "the partition's time limit"
    job = JobSpec(
        name=job_name(dump), run_dir=dump, train_argv=train_argv, nodes=request.nodes, ranks_per_node=ranks,
        gpus_per_node=gpus, grace_seconds=config.gamma.reliability.stop_grace_seconds, script=script,
        log=script.with_name("job-%j.out"), workdir=Path.cwd(), launch_command=submit_command(argv),
        about=[f"gamma-titan submit: {config_path} -> {dump}",
               f"{request.nodes} node(s) x {ranks} rank(s){f' ({gpus} GPUs each)' if gpus else ' (CPU nodes)'}, "
               f"{config.training.steps} steps, {time_line}; submit again with a larger --training.steps to extend"])
    return job, site, config


def refuse_if_queued(dump: Path, script: Path) -> None:
    known = [r["job"] for r in records.jobs(dump) if r.get("job")]
    live = scheduler.queued(known, script)
    if live:
        job, state = live[-1]
        raise ConfigError(f"{dump}: job {job} of this run is {state}; wait for it, stop it (scancel --signal=TERM "
                          f"{job}), or add --force to submit another")


def submit(request: Request, argv: list[str]) -> int:
    from gamma_titan.training.preflight import finished_run
    from gamma_titan.training.run_lock import check_free

    job, site, config = plan_job(request, argv)
    done = finished_run(config)
    if done is not None:
        print(done)
        return 0
    if request.dry_run:
        print(job_script(job, site), end="")
        print(f"# dry run: nothing written; `gamma-titan submit` without --dry-run writes this to {job.script} and "
              "submits it")
        return 0
    scheduler.command("sbatch", "use --dry-run to only see the script")  # before anything is written
    if not request.force:
        refuse_if_queued(job.run_dir, job.script)
        check_free(job.run_dir)  # a live run in the folder outside SLURM
    write_script(job, site)
    job_id = scheduler.sbatch(job.script)
    records.record_submission(job.run_dir, job_id, job.script, job.log, job.launch_command)
    log = Path(str(job.log).replace("%j", job_id))
    where = ", ".join(f"{k} {v}" for k, v in (("partition", site.partition), ("account", site.account),
                                              ("qos", site.qos)) if v)
    print(f"submitted job {job_id}: {job.nodes} node(s) x {job.ranks_per_node} rank(s)"
          + (f", {where}" if where else "") + (f", time limit {site.time}" if site.time else ""))
    print(f"  run folder: {job.run_dir}")
    print(f"  log: {log}")
    print(f"  where it stands: gamma-titan status {job.run_dir}")
    print(f"  stop for good (a checkpoint, then COMPLETED): scancel --signal=TERM {job_id}")
    print(f"  resume after a stop: sbatch {job.script}  (or this command again)")
    print(f"  extend: this command with a larger --training.steps (now {config.training.steps})")
    return 0
