"""The files of a recipe's `--out` folder, written by `recipe run` and read by `report recipe`."""

PLAN_FILE = "recipe.json"  # the plan, with each run's config and arguments
STATUS_FILE = "status.json"  # each run's outcome so far (done / failed, wall time)
