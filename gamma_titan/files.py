"""The names of the files and folders gamma-titan writes and reads, each spelled once.

A leaf module (it imports nothing of the package), so every layer may name them: the
trainer that writes a file and the report or converter that reads it.
"""

import re

#: A tokenizer folder's tokenizer, in Hugging Face `tokenizers`' format.
TOKENIZER_FILE = "tokenizer.json"

#: A run's scalars, one JSON object per logged step, in job.dump_folder (training/metrics.py).
METRICS_FILE = "metrics.jsonl"
#: Its key of a mixture source's validation loss: val_loss/<source> (training/validator.py).
SOURCE_VAL_LOSS = "val_loss/"

#: A run's log, rank 0's lines without colour codes, in job.dump_folder (training/console.py).
RUN_LOG_FILE = "train.log"

#: What a recipe run's process printed (its log lines, and any traceback), in its run folder.
CONSOLE_LOG_FILE = "console.log"

#: A checkpoint folder's record of the model its steps hold (convert/model_record.py).
MODEL_FILE = "model.json"

#: A Hugging Face model folder's index of its safetensors shards.
HF_INDEX_FILE = "model.safetensors.index.json"

#: A recipe's --out folder: the plan (each run's config and arguments), and each run's
#: outcome so far (done / failed, wall time). Written by `recipe run`, read by `report recipe`.
RECIPE_PLAN_FILE = "recipe.json"
RECIPE_STATUS_FILE = "status.json"
#: What to do about a damaged one of a recipe's records.
RECIPE_RECORD_HINT = "a record `gamma-titan recipe run` writes: rerun it (finished runs are kept) to write it again"

#: TorchTitan's name for step n's checkpoint inside checkpoint.folder.
STEP_FOLDER = re.compile(r"^step-(\d+)$")


def step_folder(step: int) -> str:
    return f"step-{step}"
