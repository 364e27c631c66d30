"""The GPU benchmark: gamma_dense 1.5B as the paper trains it, against TorchTitan's llama3.

    bash tools/bench/gpu.sh [--batch 4] [--steps 30] [--warmup 10] [--out bench_gpu.json]
    python tools/bench/gpu.py --dry-run          # the same pipeline, tiny, on the CPU (tests)

One H100/H200, no network, nothing installed. Each variant is one training run through
the real trainer (TorchTitan's Trainer with our TrainSpecs; FSDP degree 1, bf16 autocast,
torch.compile, selective activation checkpointing, seq 4096, data from the built-in
shards), in its own process:

  (a) gamma_bf16      gamma_dense 1.5B, γ = 1, ε = 1e-12, elementwise gate
  (b) gamma_none_bf16 (a) without the gate: the like-for-like partner of (c)
  (c) llama3_bf16     TorchTitan's llama3 model at the identical shape (no gate)
  (d) gamma_float8    (a) with float8 linears (torchao, tensorwise scaling; the layers the
                      model keeps in bf16: gamma_titan/training/derive.py)
  (e) gamma_diag_bf16 (a) with the live diagnostics every 10 steps: their cost per
                      measurement, extrapolated to the default freq = 100

From each run's metrics.jsonl, over the steps after `--warmup` (compilation, allocator
warm-up): median tokens/s, TFLOP/s and MFU as the trainer logs them (FLOPs per token
counted as tests/test_flops.py checks; MFU against the bf16 peak, TorchTitan's
convention, also for float8), and the peak of allocated memory. Printed as a table, the
ratios last, and written to `--out` as JSON (each variant's trainer log in `<out>_logs/`;
neither is ever overwritten). `--dry-run` runs every variant on the debug
shape for a few steps, without compile, float8 emulated: what the CPU tests exercise.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REFERENCE_MODEL = "llama3_bench"  # TorchTitan's llama3 TrainSpec, registered with our shape
#: TorchTitan's deepseek_v3 TrainSpec at gamma_moe's MLA shape (the GPU check's moe_vs_titan).
MOE_REFERENCE_MODEL = "deepseek_v3_bench"

VARIANTS = {
    "gamma_bf16": ("gamma_dense", ["--gamma.attention_gate", "elementwise"]),
    "gamma_float8": ("gamma_dense", ["--gamma.attention_gate", "elementwise",
                                     "--model.converters", "quantize.linear.float8",
                                     "--quantize.linear.float8.recipe_name", "tensorwise"]),
    "llama3_bf16": (REFERENCE_MODEL, []),
    "gamma_none_bf16": ("gamma_dense", ["--gamma.attention_gate", "none"]),
    "gamma_diag_bf16": ("gamma_dense", ["--gamma.attention_gate", "elementwise", "--gamma.diagnostics.enable", "true",
                                        "--gamma.diagnostics.freq", "10"]),
}
DEFAULT_VARIANTS = list(VARIANTS)
#: Seconds a variant may take: on a GPU, 5 x 95 s keeps the default run within 8 minutes.
VARIANT_TIMEOUT_S = 95
#: In a dry run, a guard against a hang, not a judgment of the CPU's speed. Measured on this
#: 2-core machine (2026-12-05): 6-7 s a variant alone, at most 17 s beside a 2-process
#: training, 35 s beside an 8-process one (load average 9 on 2 cores): 300 s is 8 x that.
DRY_RUN_VARIANT_TIMEOUT_S = 300
DEFAULT_DIAGNOSTICS_FREQ = 100  # gamma_titan.config.Diagnostics.freq
RATIOS = [  # (name, numerator, denominator)
    ("float8 / bf16 tokens/s (gamma, gate on)", "gamma_float8", "gamma_bf16"),
    ("gamma (gate on) / llama3 tokens/s", "gamma_bf16", "llama3_bf16"),
    ("gamma (no gate) / llama3 tokens/s", "gamma_none_bf16", "llama3_bf16"),
    ("gamma (no gate) / llama3 peak memory", "gamma_none_bf16", "llama3_bf16"),
]


def run_overrides(ns, dump: Path) -> list[str]:
    """Trainer flags shared by every variant."""
    common = [
        "--job.dump_folder", str(dump), "--training.steps", str(ns.steps),
        "--training.local_batch_size", str(ns.batch), "--training.seq_len", str(ns.seq_len),
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable", "false", "--validation.enable", "false",
        "--gamma.diagnostics.enable", "false", "--gamma.init_rate", "1.0", "--gamma.norm_eps", "1e-12",
        "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
    ]
    if ns.dry_run:
        return ["--job.config_file", str(REPO / "configs/dense/debug.toml"), *common,
                "--compile.enable", "false", "--training.mixed_precision_param", "float32",
                "--quantize.linear.float8.emulate", "true"]
    return ["--job.config_file", str(REPO / "configs/dense/1.5B.toml"), *common,
            "--compile.enable", "true", "--compile.components", "model,loss",
            "--training.mixed_precision_param", "bfloat16"]


def variant_flags(name: str, dry_run: bool) -> tuple[str, list[str]]:
    """The variant's model and flags; the dry run's emulated float8 takes no recipe
    (TorchTitan builds a recipe's config without `emulate`, and preflight refuses both)."""
    model, flags = VARIANTS[name]
    if dry_run and "--quantize.linear.float8.recipe_name" in flags:
        at = flags.index("--quantize.linear.float8.recipe_name")
        flags = flags[:at] + flags[at + 2:]
    return model, flags


# --- one variant, in its own process -------------------------------------------------------

def register_reference(model: str, gamma_argv: list[str]) -> str:
    """TorchTitan's own TrainSpec (llama3 for REFERENCE_MODEL, deepseek_v3 for
    MOE_REFERENCE_MODEL) with one flavor: the shape of our model under these flags, and our
    data, tokenizer and metrics, so that only the model differs."""
    import dataclasses

    from torchtitan.models.deepseek_v3 import get_train_spec as torchtitan_deepseek_v3_spec
    from torchtitan.models.llama3 import get_train_spec as torchtitan_llama3_spec  # TorchTitan's own, not
    from torchtitan.protocols.train_spec import register_train_spec  # the knob-aware one gamma_titan registers

    from gamma_titan.config import load_job_config
    from gamma_titan.training.train_spec import resolve_model, with_our_components

    sys.path.insert(0, str(Path(__file__).parent))
    from common import device
    from reference import deepseek_v3_args, llama3_args

    config = load_job_config(gamma_argv)
    _, args = resolve_model(config)
    if model == MOE_REFERENCE_MODEL:
        theirs = deepseek_v3_args(args, device=device())
        theirs.max_seq_len = theirs.original_seq_len = config.training.seq_len
        spec = dataclasses.replace(torchtitan_deepseek_v3_spec(), model_args={"same_shape": theirs})
    else:
        spec = dataclasses.replace(torchtitan_llama3_spec(), model_args={"same_shape": llama3_args(args)})
    register_train_spec(model, with_our_components(spec))
    return "same_shape"


def variant_config(model: str, flags: list[str]):
    """The job config of one variant in one process. Our families go through pre-flight,
    which derives the configs' "auto" (-1) degrees; TorchTitan's models do not, so their
    replicate degree (-1: one replica per node) is the one process's 1."""
    from gamma_titan.config import load_job_config
    from gamma_titan.training.preflight import preflight

    if model not in (REFERENCE_MODEL, MOE_REFERENCE_MODEL):
        config = load_job_config(flags)
        preflight(config, world_size=1)
        return config
    flavor = register_reference(model, flags)
    config = load_job_config([*flags, "--model.name", model, "--model.flavor", flavor])
    if config.parallelism.data_parallel_replicate_degree == -1:
        config.parallelism.data_parallel_replicate_degree = 1
    return config


def run_variant(argv: list[str]) -> None:
    """`gpu.py --run-variant MODEL FLAGS...`: train one variant (called by `main`)."""
    import gamma_titan  # noqa: F401  (platform shims, TrainSpecs)
    from torchtitan.tools.logging import init_logger

    from gamma_titan.training.main import run, single_process_env

    config = variant_config(argv[0], argv[1:])
    single_process_env()
    init_logger()
    if argv[0] == MOE_REFERENCE_MODEL:
        from common import device  # on the path since register_reference

        if device().type != "cuda":
            # TorchTitan's MoE counts tokens per expert with torch.histc on integers, which the
            # CPU lacks (a dry run): counted the same way by our scatter (models/common/moe.py)
            from gamma_titan.models.common.moe import IntegerHistcByScatter

            with IntegerHistcByScatter():
                run(config)
            return
    run(config)


# --- the driver ------------------------------------------------------------------------------

def summarize(dump: Path, warmup: int) -> dict:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tps" in r and r["step"] > warmup]
    if not steps:
        raise RuntimeError(f"no step after warm-up {warmup} in {dump / 'metrics.jsonl'}")
    med = lambda key: statistics.median(r[key] for r in steps)  # noqa: E731
    return {
        "tokens_per_s": med("tps"), "tflops": med("tflops"), "mfu_percent": med("mfu"),
        "peak_active_gib": max(r.get("memory/max_active(GiB)", 0.0) for r in records),
        "peak_reserved_gib": max(r.get("memory_gib", 0.0) for r in records),
        "final_loss": steps[-1].get("loss"), "timed_steps": len(steps),
        "diagnostics_s": _diagnostics_seconds(records),
    }


def _diagnostics_seconds(records: list[dict]) -> float | None:
    """Median time of one live-diagnostics measurement: the warm ones (after step 1's cold
    start) when the run had any."""
    timed = [(r["step"], r["gamma/diagnostics_seconds"]) for r in records if "gamma/diagnostics_seconds" in r]
    warm = [t for step, t in timed if step > 1] or [t for _, t in timed]
    return statistics.median(warm) if warm else None


def check_device(dry_run: bool) -> str:
    import torch

    if dry_run:
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)"
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device (use --dry-run to exercise the pipeline on the CPU)")
    return torch.cuda.get_device_name()


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-variant"]:
        run_variant(argv[1:])
        return {}
    from gamma_titan.config.flags import Parser, count  # the driver imports the package only here

    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument("--batch", type=count(1), default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=count(1), default=4096)
    parser.add_argument("--steps", type=count(1), default=30)
    parser.add_argument("--warmup", type=count(0), default=10, help="steps left out of the medians")
    parser.add_argument("--variant-timeout", type=count(1),
                        help=f"seconds per variant (default {VARIANT_TIMEOUT_S}: 5 variants stay within 8 minutes; "
                             f"with --dry-run {DRY_RUN_VARIANT_TIMEOUT_S})")
    parser.add_argument("--out", default="bench_gpu.json")
    parser.add_argument("--dry-run", action="store_true",
                        help="debug shape, 4 steps, no compile, float8 emulated: runs on the CPU")
    ns = parser.parse_args(argv)
    if ns.dry_run:
        ns.batch, ns.seq_len, ns.steps, ns.warmup = 2, 128, 4, 1
    if ns.variant_timeout is None:
        ns.variant_timeout = DRY_RUN_VARIANT_TIMEOUT_S if ns.dry_run else VARIANT_TIMEOUT_S
    if ns.warmup >= ns.steps:
        parser.error(f"--warmup {ns.warmup} must be below --steps {ns.steps}")
    out = Path(ns.out)
    logs = out.with_name(out.stem + "_logs")  # each variant's trainer log
    for path in (out, logs):
        if path.exists():
            parser.error(f"--out {out}: {path} exists; choose another name (results are never overwritten)")
    device = check_device(ns.dry_run)

    results: dict[str, dict] = {}
    logs.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gamma-bench-") as tmp:
        for name in ns.variants:
            model, flags = variant_flags(name, ns.dry_run)
            dump = Path(tmp) / name
            cmd = [sys.executable, __file__, "--run-variant", model, *run_overrides(ns, dump), *flags]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            start = time.perf_counter()
            try:
                with open(logs / f"{name}.log", "w") as log:
                    proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                          timeout=ns.variant_timeout)
            except subprocess.TimeoutExpired:
                results[name] = {"error": f"timed out after {ns.variant_timeout} s"}
                print(f"{name}: timed out after {ns.variant_timeout} s", flush=True)
                continue
            if proc.returncode != 0:
                tail = (logs / f"{name}.log").read_text().strip().splitlines()[-15:]
                results[name] = {"error": f"exit {proc.returncode}", "log_tail": tail}
                print(f"{name}: failed (exit {proc.returncode})\n  " + "\n  ".join(tail), flush=True)
                continue
            results[name] = summarize(dump, ns.warmup) | {"wall_s": round(time.perf_counter() - start, 1)}
            r = results[name]
            print(f"{name:<16} {r['tokens_per_s']:>10,.0f} tokens/s  {r['tflops']:>8.4g} TFLOP/s  "
                  f"MFU {r['mfu_percent']:6.3g}%  peak {r['peak_active_gib']:6.1f} GiB  ({r['wall_s']:.0f} s)",
                  flush=True)

    ratios = {}
    for label, a, b in RATIOS:
        ra, rb = results.get(a, {}), results.get(b, {})
        key = "peak_active_gib" if "memory" in label else "tokens_per_s"
        if ra.get(key) and rb.get(key):
            ratios[label] = ra[key] / rb[key]
    diag = results.get("gamma_diag_bf16", {})
    if diag.get("diagnostics_s") and diag.get("tokens_per_s"):  # one measurement over freq steps' time
        step_s = ns.batch * ns.seq_len / diag["tokens_per_s"]
        ratios[f"diagnostics on / off time at freq {DEFAULT_DIAGNOSTICS_FREQ}"] = (
            1 + diag["diagnostics_s"] / (DEFAULT_DIAGNOSTICS_FREQ * step_s))
    report = {"device": device, "dry_run": ns.dry_run, "batch": ns.batch, "seq_len": ns.seq_len,
              "steps": ns.steps, "warmup": ns.warmup, "variants": results, "ratios": ratios}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{device}, batch {ns.batch} x seq {ns.seq_len}, medians over steps {ns.warmup + 1}..{ns.steps}; "
          f"JSON: {out}, trainer logs: {logs}/")
    for label, value in ratios.items():
        print(f"ratio {label}: {value:.3f}")
    if any("error" in r for r in results.values()):
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
