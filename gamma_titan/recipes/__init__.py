"""The paper's experiments as recipes (recipes/*.toml): `gamma-titan recipe run`.

spec.py reads a recipe file, plan.py turns its runs into checked command lines with token
budgets, local.py and slurm.py launch them (slurm_job.py runs inside a SLURM job: requeue or
stop), run.py ties it together; the report is gamma_titan/reports/recipe.py.
"""
