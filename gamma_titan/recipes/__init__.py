"""The paper's experiments as recipes (recipes/*.toml): `gamma-titan recipe run`.

spec.py reads a recipe file, plan.py turns its runs into checked command lines with token
budgets, local.py and slurm.py launch them (slurm.py as the jobs of gamma_titan/slurm, the
launcher `gamma-titan submit` uses), run.py ties it together; the report is
gamma_titan/reports/recipe.py.
"""
