"""SLURM: a config (or a recipe's runs) as jobs that run until the run is done.

  site       the site file and flags: partition, account, setup lines, container, env, ...
  script     the one job script (submit's and recipe run --launcher slurm's)
  job        the steps the script runs inside the job: start, rendezvous, after-stop
  records    what a run folder records of its jobs: slurm/jobs.jsonl, slurm/starts.jsonl
  scheduler  the SLURM commands the launcher side calls (sbatch, squeue, scontrol)
  submit     `gamma-titan submit`
  status     `gamma-titan status`

Arrows point down: nothing here is imported by training/ or models/; job.py, which runs on
the nodes, calls no SLURM command itself and imports torch only to ask what its torchrun takes.
"""
