"""`gamma-titan`: the command line.

    gamma-titan train CONFIG.toml [--nproc N] [--section.key value ...]
    gamma-titan submit CONFIG.toml [--nodes N] [--gpus-per-node G] [--time LIMIT] [--partition P] [--account A]
                                   [--qos Q] [--constraint C] [--sbatch LINE ...] [--site FILE] [--dry-run] [--force]
                                   [--section.key value ...]
    gamma-titan status RUN_DIR
    gamma-titan inspect CONFIG.toml [--json] [--section.key value ...]
    gamma-titan tokenizer train [--input SOURCE --out DIR] [--mixture TABLE] [--vocab-size N] [--force]
    gamma-titan pretokenize --input SOURCE --tokenizer DIR --out DIR [--num-proc N] [--val-fraction F]
    gamma-titan convert to-hf CHECKPOINT_DIR OUT_DIR [--dtype fp32|bf16] [--overwrite]
    gamma-titan convert from-hf HF_DIR CHECKPOINT_DIR [--overwrite]
    gamma-titan eval HF_DIR [--tasks T ...] [--paper-suite] [--local-task NAME=FILE.jsonl ...] [--limit N]
    gamma-titan eval compare A.json B.json [--labels A B] [--out FILE.md]
    gamma-titan report condensation RUN_DIR [RUN_DIR ...] [--out DIR] [--matrices NAME ...] [--steps N ...]
    gamma-titan report recipe RUN_ROOT [--out DIR]
    gamma-titan report tokens CKPT_SMALL CKPT_STD [--data NAME|DIR] [--tokens N] [--text T] [--out DIR]
    gamma-titan recipe run NAME --scale tiny|gpu|paper [--launcher local|slurm] [--dry-run] [--out DIR] [--jobs N]
                           [--steps N] [--seeds S,S,...] [--allow-epochs E] [SLURM settings as submit's]
                                [--section.key value ...]   (overrides for every run)
    gamma-titan recipe list
    gamma-titan cache [clear [ENTRY ...]]

`train` checks the config here, then starts `torchrun -m gamma_titan.train` with N
processes on this node (default: the number of GPUs, or 1 without one); one process trains
in this one, as a world of one. `submit` runs a config as a SLURM job on N nodes that
requeues itself until the run is done (its site settings: --site FILE or
$GAMMA_TITAN_SLURM_SITE); `status` says where a run (or a recipe's runs) stands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gamma_titan.config.flags import Parser, count, number, seed_list
from gamma_titan.errors import ConfigError
from gamma_titan.recipes.spec import SCALES


def _config_argv(config: str, overrides: list[str]) -> list[str]:
    return ["--job.config_file", config, *overrides]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


#: GPUs a node holds, for `inspect --memory`'s layouts (an 8 x H100 node).
GPUS_PER_NODE = 8


def cmd_train(ns, overrides: list[str]) -> int:
    from gamma_titan.config import load_job_config
    from gamma_titan.training.preflight import finished_run, preflight

    nproc = _default_nproc() if ns.nproc is None else ns.nproc
    argv = _config_argv(ns.config, overrides)
    config = load_job_config(argv)
    spec, args = preflight(config, world_size=nproc, local_world_size=nproc)  # fail here, before torchrun starts
    done = finished_run(config)
    if done is not None:  # no launch, no run record
        print(done)
        return 0
    from gamma_titan.training.run_lock import check_free

    check_free(config.job.dump_folder)  # a live run in this folder: refused before torchrun starts
    from gamma_titan.training.launch import launch_command, torchrun_command
    from gamma_titan.training.run_record import LAUNCH_COMMAND_ENV

    if nproc == 1:  # a world of one: this process trains (torchrun would only import everything again)
        from gamma_titan.training.main import train

        os.environ[LAUNCH_COMMAND_ENV] = launch_command()
        print("+ training in this process (one rank; with --nproc N > 1, torchrun starts N)", flush=True)
        train(config, spec, args)
        return 0
    command, env = torchrun_command(nproc, argv, config.gamma.reliability.stop_grace_seconds)
    print("+ " + " ".join(command), flush=True)
    os.execve(command[0], command, env)  # torchrun takes this process: SIGTERM reaches it directly


def site_flags(ns) -> dict:
    """The SLURM settings given as flags (None: not given)."""
    return {"partition": ns.partition, "account": ns.account, "qos": ns.qos, "constraint": ns.constraint,
            "time": ns.time, "sbatch": ns.sbatch}


def cmd_submit(ns, overrides: list[str]) -> int:
    from gamma_titan.slurm.submit import Request, submit

    request = Request(config=ns.config, overrides=overrides, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node,
                      nproc_per_node=ns.nproc_per_node, site_file=ns.site, flags=site_flags(ns), dry_run=ns.dry_run,
                      force=ns.force)
    return submit(request, ns.argv[1:])  # as typed after `submit`: the command that submits it again


def cmd_status(ns, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    from gamma_titan.slurm.status import status

    return status(ns.run_dir)


def cmd_inspect(ns, overrides: list[str]) -> int:
    from gamma_titan.config import load_job_config
    from torchtitan.tools.utils import device_type

    from gamma_titan.inspect_model import format_report, inspect_model, tokens_per_step, weight_decay_report
    from gamma_titan.training.main import attention_kernels
    from gamma_titan.training.train_spec import mask_tokenizer, resolve_model

    config = load_job_config(_config_argv(ns.config, overrides))
    if ns.memory:  # the layout at that many GPUs, 8 a node (derive.py fills in the degrees)
        from gamma_titan.training.preflight import preflight

        gpus = ns.gpus or GPUS_PER_NODE
        spec, args = preflight(config, world_size=gpus, local_world_size=min(gpus, GPUS_PER_NODE))
    else:
        spec, args = resolve_model(config)
    report = inspect_model(spec, args, config.training.seq_len, tokenizer=mask_tokenizer(config, args))
    report["tokens_per_step"] = tokens_per_step(config)
    report["weight_decay"] = weight_decay_report(spec, args, config.optimizer.weight_decay_policy)
    report["attention_kernels"] = attention_kernels(args, config, device_type)  # on this machine's accelerator
    text = None if ns.json else format_report(report)
    if ns.memory:
        from gamma_titan.estimate import estimate_rank

        estimate = estimate_rank(config, spec, args, gpus)
        report["estimate"] = estimate.as_dict(ns.gpu_memory)
        text = None if ns.json else text + "\n" + estimate.format(ns.gpu_memory)
    print(json.dumps(report) if ns.json else text)
    return 0


def cmd_tokenizer_train(ns, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    from gamma_titan.data.tokenizer import ensure_builtin_tokenizer, train_tokenizer_from

    if ns.input is None:
        if ns.out is not None or ns.mixture is not None:
            raise ConfigError(f"{'--out' if ns.out is not None else '--mixture'}: needs --input (without it, the "
                              "built-in tokenizer is built in the cache)")
        print(ensure_builtin_tokenizer(ns.vocab_size, force=ns.force))
        return 0
    if ns.out is None:
        raise ConfigError("--out: required with --input (the folder to write the tokenizer to)")
    from gamma_titan.data.clean_text import TextErrors

    errors = None if ns.errors == "strict" else TextErrors(ns.errors)
    print(train_tokenizer_from(ns.input, ns.vocab_size, ns.out, force=ns.force, errors=errors, mixture=ns.mixture))
    if errors is not None:
        print(errors.summary())
    return 0


def cmd_pretokenize(ns, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    from gamma_titan.data.pretokenize import pretokenize
    from gamma_titan.data.tokenizer import resolve_tokenizer_path

    tokenizer = resolve_tokenizer_path(ns.tokenizer, key="--tokenizer")
    result = pretokenize(ns.input, tokenizer, ns.out, val_input=ns.val_input, val_fraction=ns.val_fraction,
                         num_proc=ns.num_proc, docs_per_shard=ns.docs_per_shard, progress=not ns.quiet,
                         errors=ns.errors, restart=ns.restart)
    print(f"{ns.out}: {result.summary()}")
    return 0


def cmd_convert(ns, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    from gamma_titan.convert import hf

    if ns.direction == "to-hf":
        out = hf.to_hf(ns.source, ns.target, dtype=ns.dtype, overwrite=ns.overwrite, tokenizer=ns.tokenizer)
    else:
        out = hf.from_hf(ns.source, ns.target, overwrite=ns.overwrite)
    print(out)
    return 0


def cmd_eval(ns, overrides: list[str]) -> int:
    from gamma_titan import evaluation

    if ns.hf_dir == "compare":  # gamma-titan eval compare A.json B.json
        if len(overrides) != 2:
            raise ConfigError("eval compare: give two result files, A.json B.json")
        table = evaluation.compare(*overrides, labels=tuple(ns.labels) if ns.labels else None)
        if ns.out:
            Path(ns.out).write_text(table, encoding="utf-8")
        print(table, end="")
        return 0
    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    out = evaluation.run(ns.hf_dir, ns.tasks or [], local_tasks=ns.local_task or [], paper_suite=ns.paper_suite,
                         include_path=ns.include_path, limit=ns.limit, num_fewshot=ns.num_fewshot,
                         batch_size=ns.batch_size, out=ns.out, overwrite=ns.overwrite,
                         device=ns.device or ("cuda" if _cuda() else "cpu"))
    print(evaluation.metrics_table(out), end="")
    print(f"results: {out}")
    return 0


def cmd_report_condensation(ns, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    from pathlib import Path

    from gamma_titan.reports.condensation import write_report

    runs = [Path(r) for r in ns.runs]
    out = Path(ns.out) if ns.out else runs[0] / "report"
    for path in write_report(runs, out, ns.matrices or None, ns.steps or None):
        print(path)
    return 0


def cmd_report_recipe(ns, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    from gamma_titan.reports.recipe import write_report

    print(write_report(ns.root, ns.out))
    return 0


def cmd_report_tokens(ns, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    from gamma_titan.reports.tokens import write_token_report

    out = Path(ns.out) if ns.out else Path("token_report")
    for path in write_token_report(ns.small, ns.std, out, data=ns.data, max_tokens=ns.tokens, text=ns.text,
                                   seq_len=ns.seq_len, overwrite=ns.overwrite):
        print(path)
    return 0


def cmd_cache(ns, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    from gamma_titan.data.cache import CACHE_KINDS, cache_dir, cache_entries, clear_cache

    if ns.action == "clear":
        removed = clear_cache(ns.entries)
        print(f"{cache_dir()}: removed {len(removed)} entries, {sum(b for _, b in removed) / 2**20:.1f} MiB")
        return 0
    if ns.entries:
        raise ConfigError(f"cache: entries are named to `cache clear` only (got {' '.join(ns.entries)})")
    entries = cache_entries()
    print(f"{cache_dir()} (${'GAMMA_TITAN_CACHE'} moves it): {sum(b for _, b in entries) / 2**20:.1f} MiB")
    for kind, what in CACHE_KINDS.items():
        mine = [(e, b) for e, b in entries if e == kind or e.startswith(kind + "/")]
        if mine:
            print(f"  {kind}/: {what}")
            print("\n".join(f"    {e:<48} {b / 2**20:9.1f} MiB" for e, b in mine))
    return 0


def cmd_recipe(ns, overrides: list[str]) -> int:
    from gamma_titan.recipes.run import run_recipe
    from gamma_titan.recipes.spec import available, load_recipe

    if ns.action == "list":
        if overrides:
            raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
        for name in available():
            recipe = load_recipe(name)
            print(f"{name:14s} {recipe.figure:10s} {recipe.title}")
        return 0
    flags = site_flags(ns)
    site = None
    if ns.site or any(v is not None for v in flags.values()):
        if ns.launcher != "slurm":
            given = "--site" if ns.site else "--" + next(k for k, v in flags.items() if v is not None)
            raise ConfigError(f"{given}: a SLURM setting; it goes with --launcher slurm")
        from gamma_titan.slurm.site import load_site

        site = load_site(ns.site).merged(**flags)
    return run_recipe(ns.name, ns.scale, launcher=ns.launcher, dry_run=ns.dry_run, out=ns.out, jobs=ns.jobs,
                      overrides=overrides, steps=ns.steps, seeds=ns.seeds, allow_epochs=ns.allow_epochs, site=site)


def add_site_flags(parser) -> None:
    """The SLURM settings of submit and recipe run: each overrides the site file's key."""
    from gamma_titan.slurm.site import SITE_ENV

    parser.add_argument("--site", metavar="FILE", help=f"the cluster's site settings (TOML; default: ${SITE_ENV}): "
                                                       "partition, account, setup lines, container, env, ...")
    parser.add_argument("--partition", help="#SBATCH --partition")
    parser.add_argument("--account", help="#SBATCH --account")
    parser.add_argument("--qos", help="#SBATCH --qos")
    parser.add_argument("--constraint", help="#SBATCH --constraint")
    parser.add_argument("--time", metavar="LIMIT", help="#SBATCH --time (minutes, H:M:S, D-H:M:S, ...); the job "
                                                        "stops its training before it, checkpointed, and requeues")
    parser.add_argument("--sbatch", action="append", metavar="LINE",
                        help="another #SBATCH option, e.g. --sbatch=--mail-type=END (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from gamma_titan.data.tokenizer import DEFAULT_BUILTIN_VOCAB, MIN_VOCAB_SIZE
    from gamma_titan.data.clean_text import POLICIES

    errors_help = ("text that is not clean (bytes not UTF-8, a null or non-string text, a line that is not JSON): "
                   "strict refuses it in one line naming the file and line; replace puts U+FFFD for each "
                   "undecodable byte; skip leaves such documents out (both skip records without a string "
                   "text, and count what they did); local files only")

    parser = Parser(prog="gamma-titan", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="check a config and launch training with torchrun")
    train.add_argument("config", help="TOML file (configs/...)")
    train.add_argument("--nproc", type=count(1), help="processes on this node (default: its GPUs, or 1)")
    train.set_defaults(run=cmd_train)

    submit = sub.add_parser("submit", help="run a config as a SLURM job that requeues itself until the run is done",
                            description="Check a config at N nodes x G GPUs, write its job script into "
                                        "<dump_folder>/slurm/ and submit it. Again with a larger --training.steps: "
                                        "the run is extended.")
    submit.add_argument("config", help="TOML file (configs/... or your own)")
    submit.add_argument("--nodes", type=count(1), default=1, help="nodes (default 1)")
    submit.add_argument("--gpus-per-node", type=count(0),
                        help="GPUs a node (one rank each; 0: CPU nodes; default: the site file's, else 8)")
    submit.add_argument("--nproc-per-node", type=count(1), help="ranks a CPU node (--gpus-per-node 0; default 1)")
    add_site_flags(submit)
    submit.add_argument("--dry-run", action="store_true", help="check and print the job script; write and submit nothing")
    submit.add_argument("--force", action="store_true", help="submit while a job of this run is pending or running")
    submit.set_defaults(run=cmd_submit)

    status = sub.add_parser("status", help="where a run stands: its SLURM job, step, checkpoint, starts, ETA")
    status.add_argument("run_dir", metavar="RUN_DIR", help="a run's dump folder, or a recipe's --out")
    status.set_defaults(run=cmd_status)

    inspect = sub.add_parser("inspect", help="the model of a config at init, on the CPU")
    inspect.add_argument("config")
    inspect.add_argument("--json", action="store_true", help="one JSON object")
    inspect.add_argument("--memory", action="store_true",
                         help="also estimate one rank's memory of a training step and its init, on --gpus GPUs")
    inspect.add_argument("--gpus", type=count(1), help=f"GPUs of the layout for --memory ({GPUS_PER_NODE} a node; "
                                                  f"default {GPUS_PER_NODE})")
    inspect.add_argument("--gpu-memory", type=number(0), default=80.0, metavar="GiB",
                         help="the GPU's memory for --memory's fits / does not fit (default 80: an H100)")
    inspect.set_defaults(run=cmd_inspect)

    tok = sub.add_parser("tokenizer", help="tokenizers").add_subparsers(dest="action", required=True)
    tok_train = tok.add_parser("train", help="train a byte-level BPE tokenizer (default: the built-in one, cached)")
    tok_train.add_argument("--input", help="text to train on: a .jsonl/.json/.parquet/.txt file or folder (kinds "
                                           "may mix), a save_to_disk folder, a hub id (records need a 'text' "
                                           "field), or a mixture file of such sources")
    tok_train.add_argument("--mixture", help="mix the sources in --input's folder by weight, as shard folders are: "
                                             "'{ web = 0.7, code = 0.3 }' or a mixture file (.toml/.json)")
    tok_train.add_argument("--out", help="folder to write tokenizer.json and tokenizer_config.json to")
    tok_train.add_argument("--vocab-size", type=count(MIN_VOCAB_SIZE), default=DEFAULT_BUILTIN_VOCAB)
    tok_train.add_argument("--force", action="store_true", help="retrain even if cached / replace the one in --out")
    tok_train.add_argument("--errors", choices=POLICIES, default="strict", help=errors_help)
    tok_train.set_defaults(run=cmd_tokenizer_train)

    from gamma_titan.data.pretokenize import DEFAULT_DOCS_PER_SHARD

    pre = sub.add_parser("pretokenize", help="tokenize text into token shards for dataset = \"memmap\"")
    pre.add_argument("--input", required=True, help="documents: same sources as tokenizer train --input")
    pre.add_argument("--tokenizer", required=True, help='tokenizer folder (tokenizer.json), or "builtin"')
    pre.add_argument("--out", required=True, help="shard folder to write (rerun the same command to resume)")
    pre.add_argument("--num-proc", type=count(1), default=1, help="tokenizing processes")
    pre.add_argument("--val-fraction", type=number(0, 1, low_open=False, high_open=True), default=0.0,
                     help="fraction of documents held out for validation (by a hash of their text)")
    pre.add_argument("--val-input", help="documents for the validation split (besides --val-fraction)")
    pre.add_argument("--docs-per-shard", type=count(1), default=DEFAULT_DOCS_PER_SHARD,
                     help="documents per work unit and shard")
    pre.add_argument("--errors", choices=POLICIES, default="strict", help=errors_help)
    pre.add_argument("--restart", action="store_true",
                     help="replace the shards --out holds from other settings (refused without it)")
    pre.add_argument("--quiet", action="store_true", help="no progress bar")
    pre.set_defaults(run=cmd_pretokenize)

    convert = sub.add_parser("convert", help="DCP checkpoints <-> Hugging Face folders").add_subparsers(
        dest="direction", required=True)
    to_hf = convert.add_parser("to-hf", help="a checkpoint/step-N folder -> a folder transformers loads")
    to_hf.add_argument("source", metavar="CHECKPOINT_DIR")
    to_hf.add_argument("target", metavar="OUT_DIR")
    to_hf.add_argument("--dtype", default="fp32", help="fp32 (exact) or bf16")
    to_hf.add_argument("--tokenizer", help="tokenizer folder, if the run's (named in model.json) moved")
    to_hf.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    to_hf.set_defaults(run=cmd_convert)
    from_hf = convert.add_parser("from-hf", help="a Hugging Face folder -> a model-only DCP checkpoint")
    from_hf.add_argument("source", metavar="HF_DIR")
    from_hf.add_argument("target", metavar="CHECKPOINT_DIR")
    from_hf.add_argument("--overwrite", action="store_true", help="replace a non-empty CHECKPOINT_DIR")
    from_hf.set_defaults(run=cmd_convert)

    ev = sub.add_parser("eval", help="lm-evaluation-harness on a converted model; `eval compare A.json B.json`")
    ev.add_argument("hf_dir", metavar="HF_DIR", help="a folder from `convert to-hf` (or the word compare)")
    ev.add_argument("--tasks", nargs="*", help="lm-eval task names")
    ev.add_argument("--paper-suite", action="store_true", help="the paper's tasks (needs a network for their data)")
    ev.add_argument("--local-task", nargs="*", metavar="NAME=FILE.jsonl",
                    help='multiple-choice task over a local jsonl of {"question", "choices", "answer"}')
    ev.add_argument("--include-path", help="folder of your own lm-eval task YAMLs")
    ev.add_argument("--limit", type=number(0), help="at most this many examples per task (or a fraction)")
    ev.add_argument("--num-fewshot", type=count(0))
    ev.add_argument("--batch-size", type=count(1), default=8)
    ev.add_argument("--device", help="cuda or cpu (default: cuda where there is one)")
    ev.add_argument("--out", help="results JSON (default HF_DIR/eval/results.json); compare: markdown file")
    ev.add_argument("--labels", nargs=2, help="compare: column names for the two runs")
    ev.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ev.set_defaults(run=cmd_eval)

    report = sub.add_parser("report", help="offline reports on runs").add_subparsers(dest="report", required=True)
    condensation = report.add_parser(
        "condensation", help="stable-rank trajectories, row-cosine maps and sink scores from checkpoints and logs")
    condensation.add_argument("runs", nargs="+", metavar="RUN_DIR", help="dump folders of runs to compare")
    condensation.add_argument("--out", help="output folder (default: RUN_DIR/report of the first run)")
    condensation.add_argument("--matrices", nargs="*", metavar="NAME",
                              help="weights for row-cosine maps (default: layer 0's attention.wo and FFN w1)")
    condensation.add_argument("--steps", nargs="*", type=count(0), metavar="STEP",
                              help="checkpoint steps for the row-cosine maps (default: first, middle, last)")
    condensation.set_defaults(run=cmd_report_condensation)
    recipe_report = report.add_parser("recipe", help="tables and plots of a recipe's runs (markdown + PNG)")
    recipe_report.add_argument("root", metavar="RUN_ROOT", help="the --out folder of `gamma-titan recipe run`")
    recipe_report.add_argument("--out", help="output folder (default: RUN_ROOT/report)")
    recipe_report.set_defaults(run=cmd_report_recipe)
    tokens = report.add_parser("tokens", help="token-level loss analysis of two checkpoints (paper Fig. 4a-c)")
    tokens.add_argument("small", metavar="CKPT_SMALL", help="checkpoint/step-N of the small-init model")
    tokens.add_argument("std", metavar="CKPT_STD", help="checkpoint/step-N of the standard-init model")
    tokens.add_argument("--data", default="builtin_validation",
                        help='token data: "builtin_validation", "builtin" or a pretokenized shard folder')
    tokens.add_argument("--tokens", type=count(1), default=100_000, help="at most this many tokens scored")
    tokens.add_argument("--seq-len", type=count(1), help="context length (default: the models' training one)")
    tokens.add_argument("--text", help="text to colour by per-token gain in the HTML (default: a data sequence)")
    tokens.add_argument("--out", help="output folder (default: ./token_report)")
    tokens.add_argument("--overwrite", action="store_true", help="replace files in a non-empty --out")
    tokens.set_defaults(run=cmd_report_tokens)

    recipe = sub.add_parser("recipe", help="the paper's experiments as sets of runs (recipes/*.toml)")
    recipe_sub = recipe.add_subparsers(dest="action", required=True)
    recipe_run = recipe_sub.add_parser(
        "run", help="plan, launch (local or SLURM) and report a recipe",
        description="Plan a recipe's runs at a scale (the steps from its token budget; the measuring frequencies "
                    "and the checkpoint where nothing set them), check every run, then train them here or submit "
                    "one SLURM job each. One config of your own is no recipe: `gamma-titan train CONFIG` here, "
                    "`gamma-titan submit CONFIG` on SLURM.")
    recipe_run.add_argument("name", metavar="NAME", help="a recipe in recipes/ (see `recipe list`) or a .toml path")
    recipe_run.add_argument("--scale", required=True, choices=list(SCALES),
                            help="tiny: CPU, minutes per run; gpu: one GPU, about an hour per recipe; paper: the "
                                 "paper's sizes and budgets on a cluster")
    recipe_run.add_argument("--launcher", default="local", choices=["local", "slurm"])
    recipe_run.add_argument("--dry-run", action="store_true",
                            help="print every run (slurm: also write the sbatch scripts); train nothing")
    recipe_run.add_argument("--out", help="folder for the runs, scripts and report (default: runs/NAME-SCALE)")
    recipe_run.add_argument("--jobs", type=count(1), default=1, help="local: runs trained at once")
    recipe_run.add_argument("--steps", type=count(1), help="every run trains this many steps instead of its token budget "
                                                      "(a smoke test; tiny: a multiple of 4)")
    recipe_run.add_argument("--seeds", type=seed_list, help="comma-separated seeds every run is repeated over, instead of the "
                                            "scale's (init and data order change with the seed)")
    recipe_run.add_argument("--allow-epochs", type=number(0),
                            help="passes over the training data a run may make (default: the scale's, 1)")
    add_site_flags(recipe_run)
    recipe_run.set_defaults(run=cmd_recipe)
    recipe_sub.add_parser("list", help="the recipes in recipes/").set_defaults(run=cmd_recipe)

    cache = sub.add_parser("cache", help="what the cache holds (the built-in corpus, tokenizers, shards); clear it")
    cache.add_argument("action", nargs="?", choices=("list", "clear"), default="list")
    cache.add_argument("entries", nargs="*", help="clear: entries (kind/name) or kinds to remove; none: everything")
    cache.set_defaults(run=cmd_cache)
    return parser


#: What each command leaves when Ctrl-C stops it, and so what its rerun does.
AFTER_CTRL_C = {
    "train": "rerun the same command: it resumes from the run's last checkpoint, if it saved one",
    "pretokenize": "the finished shards are kept: rerun the same command to go on from them",
    "tokenizer": "no tokenizer was written: rerun the command",
    "convert": "nothing was written (the folder is renamed into place only when whole): rerun the command",
    "eval": "no results were written: rerun the command",
    "recipe": "the finished runs are kept: rerun the same command to train the others",
    "report": "no report was written: rerun the command",
    "inspect": "nothing was written",
    "submit": "nothing was submitted unless it said so: run `gamma-titan status` on the run folder",
    "status": "nothing was written",
    "cache": "an entry being removed may be half gone: `gamma-titan cache clear` it again",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ns, rest = build_parser().parse_known_args(argv)
    ns.argv = argv
    try:
        from gamma_titan.config.parse import check_given_once

        check_given_once(rest)  # a `--section.key` typed twice: tyro would keep the last silently
        code = ns.run(ns, rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # one line, not the traceback of wherever it struck
        what = AFTER_CTRL_C.get(ns.command, "rerun the command")
        print(f"\ninterrupted: {ns.command} stopped by Ctrl-C; {what}", file=sys.stderr)
        code = 130  # the shell's code for SIGINT
    sys.exit(code)


if __name__ == "__main__":
    main()
