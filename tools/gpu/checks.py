"""The checks of the GPU acceptance check: what each one runs, and its time budget.

Each check runs the real CLI (`gamma-titan inspect`, `gamma-titan train`, which is torchrun)
in processes of its own, within a budget built from its parts (`Budget`, below). A run
that outlives its check's budget is killed with everything it started
(tools/gpu/procs.py). What a check must see to PASS is in tools/gpu/judges.py. Each check
judges only what it ran: a figure that needs another check's run (the float8 loss against
bf16's, the gate's cost, the diagnostics) reads "not measured" when that run is missing.

On one H100/H200 the budgets add up to at most ONE_GPU_SECONDS; the checks that need more
GPUs print SKIP there, and add their own budgets where they run. `dry_run` runs the same
pipeline on the CPU at debug shapes, eager, float8 emulated.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .judges import MFU_FLOOR_PERCENT, MIN_LOSS_DROP, MIN_SPEED_VS_TITAN, Run, Verdict, judge_dense, judge_diagnostics, \
    judge_drill, judge_float8, judge_kernels, judge_moe, judge_parallel, judge_vs_titan
from .procs import run_until

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "gamma_titan.cli"]
BENCH_GPU = REPO / "tools" / "bench" / "gpu.py"  # registers TorchTitan's llama3 at our shape

# --- budgets ---------------------------------------------------------------------------------------

#: The wheels' install, the closure check and the built-in tokenizer and shards: 6 s on the
#: H200 machine (2026-12-04), 23 s on this 2-core one.
INSTALL_SECONDS = 15
#: The driver's start before the first check: the machine's versions, the imports.
DRIVER_START_SECONDS = 10
#: What the checks of one GPU may take together: with the install and the driver's start
#: the whole gpu_check.sh stays within 8 minutes.
ONE_GPU_SECONDS = 8 * 60 - INSTALL_SECONDS - DRIVER_START_SECONDS
#: Margin on every estimate: a budget is 1.5 x what its parts add up to.
MARGIN = 1.5
#: A GPU's first compile of a graph against CPU Inductor's (tools/gpu/compile_times.py, on
#: this 2-core machine): the same dynamo trace, AOT autograd and lowering, then Triton
#: kernels compiled by 16 workers where C++ had 2 here. Measured on two cold H200 machines
#: (gpu_check.json: each run's compile_seconds): dense 17.7 and 21.0 s against 47.1 s, MoE
#: MLA 22.5 and 30.0 s against 59.9 s, like llama3 12.7 and 15.2 s against 29.4 s:
#: 0.38-0.52.
GPU_COMPILE_FACTOR = 0.55
#: TorchTitan's trainer sleeps this long at the end of every run (torchtitan/train.py,
#: "Sleeping 2 seconds for other ranks to complete").
END_SLEEP_S = 2.0
#: Interpreter, torch and torchtitan imports, pre-flight, the CUDA context, the data loader
#: and the exit of a run: 15-20 s a run on the H200 outside its compile, steps and
#: measurements, less the 2 s end sleep and a 3 s init.
LAUNCH_S = 13.0

#: Cold compile seconds of each compiled run (fwd + bwd graphs with selective AC, the loss),
#: measured with CPU Inductor (python tools/gpu/compile_times.py, 2026-12-04, torch 2.13
#: CPU, 2 cores): dense_default cold; dense_like_llama3 after it (one cache, as on the GPU);
#: dense_llama3 and moe_mla_bf16 cold, each alone.
CPU_COMPILE_S = {"dense_default": 47.1, "dense_like_llama3": 29.4, "dense_llama3": 36.3, "moe_mla_bf16": 59.9}
#: Emulated float8 cannot be compiled on a CPU: its graph is the bf16 one with an amax, a
#: scale and a cast around every linear's three matmuls. On the H200 it compiled in 1.08 and
#: 1.21 x the bf16 graph's time (19.1 s against 17.7 s, 25.5 against 21.0); taken as 1.25.
FLOAT8_COMPILE_FACTOR = 1.25
CPU_COMPILE_S["dense_float8"] = FLOAT8_COMPILE_FACTOR * CPU_COMPILE_S["dense_default"]
#: moe_vs_titan's two runs, not measured on their own: the same MLA shape as moe_mla_bf16
#: without the gate (ours) or in TorchTitan's code (deepseek_v3), each cold; taken as its.
CPU_COMPILE_S["moe_like_deepseek_v3"] = CPU_COMPILE_S["moe_deepseek_v3"] = CPU_COMPILE_S["moe_mla_bf16"]


@dataclass(frozen=True)
class Budget:
    """Seconds on one H100/H200 (16 CPU cores), from the parts of a check, times MARGIN.
    runs: processes started (each pays LAUNCH_S and TorchTitan's END_SLEEP_S);
    init: drawing the weights (~1 ns a value on 16 threads); compile: GPU_COMPILE_FACTOR
    x the CPU Inductor measurement of its runs; steps: training steps at the stated MFU;
    diagnostics: live measurements; io: checkpoint bytes at the slowest disk it allows;
    read: reading another check's run."""

    runs: int = 0
    init: float = 0.0
    compile: float = 0.0
    steps: float = 0.0
    diagnostics: float = 0.0
    io: float = 0.0
    read: float = 0.0

    @property
    def seconds(self) -> int:
        parts = self.runs * (LAUNCH_S + END_SLEEP_S) + self.init + GPU_COMPILE_FACTOR * self.compile + self.steps
        return math.ceil(MARGIN * (parts + self.diagnostics + self.io + self.read))


#: Steps of every timed run: a loss that falls and a steady tokens/s need about 12, the
#: first WARMUP of them (compile, allocator warm-up) left out of the timings.
STEPS, WARMUP = 12, 4
STEP_S_DENSE = 0.46  # 1.5B: 9.8 GFLOP/token x 16,384 tokens at 35% of 989 TFLOP/s (H200: 0.33 s, 49.5%)
STEP_S_MOE = 0.40  # 3B-A0.5B MLA: ~3.5 GFLOP/token x 16,384 tokens at 15%
#: One live-diagnostics measurement of the 1.5B model (probe batch of 4, every layer's sink
#: and the weights' stable ranks: SVDs of 2048-wide matrices): 0.93 s on the H200.
DIAGNOSTICS_S = 2.0
#: The drill's model: 1.5B widths at 2 layers (317M parameters, 3.8 GB a full checkpoint).
DRILL_LAYERS = 2
DRILL_CHECKPOINT_BYTES = 3.8e9
#: The slowest disk the drill's budget allows for (it measures the real one first and
#: judges the save against that: judges.judge_drill); slower, and it times out. The H200
#: machines wrote and synced 1 GiB at 2.07 and 1.51 GB/s; DCP saved at 0.54-0.91 GB/s there.
SLOWEST_DISK_BYTES_PER_S = 1e9
SLOWEST_SAVE_BYTES_PER_S = 0.5e9
#: What the disk check writes and syncs before the drill.
DISK_PROBE_BYTES = 2**30

BUDGETS: dict[str, Budget] = {
    # gamma_dense 1.5B with the default knobs, live diagnostics at steps 1, 5, 10
    "dense_bf16": Budget(runs=1, init=3, compile=CPU_COMPILE_S["dense_default"], steps=STEPS * STEP_S_DENSE,
                         diagnostics=3 * DIAGNOSTICS_S),
    # the float8 block and loss graphs cold, steps ~15% faster
    "dense_float8": Budget(runs=1, init=3, compile=CPU_COMPILE_S["dense_float8"], steps=STEPS * 0.85 * STEP_S_DENSE),
    "moe_mla_bf16": Budget(runs=1, init=4, compile=CPU_COMPILE_S["moe_mla_bf16"], steps=STEPS * STEP_S_MOE),
    # the disk probe, then two eager runs: saves at steps 3 and 6 and at SIGTERM (the signal
    # lands 1-3 steps after step 4), a load and a model-only last save (a third of the bytes)
    "sigterm_drill": Budget(runs=2, init=2 * 2, steps=8 * 0.3, io=DISK_PROBE_BYTES / SLOWEST_DISK_BYTES_PER_S
                            + (4 + 1 / 3) * DRILL_CHECKPOINT_BYTES / SLOWEST_SAVE_BYTES_PER_S),
    # gamma_dense like llama3 and TorchTitan's llama3 at the same shape
    "dense_vs_titan": Budget(runs=2, init=2 * 3, compile=CPU_COMPILE_S["dense_like_llama3"]
                             + CPU_COMPILE_S["dense_llama3"], steps=2 * STEPS * STEP_S_DENSE),
    # gamma_moe like deepseek_v3 and TorchTitan's deepseek_v3 at the same shape, each compiled cold
    "moe_vs_titan": Budget(runs=2, init=2 * 4, compile=CPU_COMPILE_S["moe_like_deepseek_v3"]
                           + CPU_COMPILE_S["moe_deepseek_v3"], steps=2 * STEPS * STEP_S_MOE),
    # from dense_bf16's run: no process of its own
    "diagnostics": Budget(read=2),
    # one process, 6 configs inspected 2 layers deep on the CPU (~3 s each)
    "inspect": Budget(runs=1, init=18),
}
#: Three runs of a debug model each, eager, STEPS steps.
MULTI_GPU_BUDGET = Budget(runs=3, init=3, steps=3 * STEPS * 0.1)
#: A dry run's budget for every check: a guard against a hang, not a judgment of the CPU's
#: speed (a dry run checks that each path runs and is judged). Measured on this 2-core
#: machine (2026-12-05): the slowest check 14 s alone (sigterm_drill), 21 s beside a
#: 2-process training, 37 s beside an 8-process one (load average 9 on 2 cores): 300 s is
#: 8 x the worst of these.
DRY_RUN_BUDGET_S = 300


@dataclass
class Setup:
    """What every check shares: where its logs and runs go, and the GPU or dry-run scale."""

    logs: Path
    dry_run: bool = False
    gpus: int = 1
    steps: int = STEPS
    warmup: int = WARMUP
    dense: str = "configs/dense/1.5B.toml"
    moe: list[str] = field(default_factory=lambda: ["configs/moe/3B-A0.5B.toml", "--model.flavor", "3B-A0.5B-mla"])
    drill: list[str] = field(default_factory=lambda: ["configs/dense/1.5B.toml", "--model_args.n_layers",
                                                      str(DRILL_LAYERS)])
    #: Every attention kind and MoE size, inspected one dense and one MoE block deep.
    inspected: list[list[str]] = field(default_factory=lambda: [
        ["configs/dense/1.5B.toml"], ["configs/moe/1.5B-A0.25B.toml"],
        ["configs/moe/1.5B-A0.25B.toml", "--model.flavor", "1.5B-A0.25B-mla"], ["configs/moe/3B-A0.5B.toml"],
        ["configs/moe/3B-A0.5B.toml", "--model.flavor", "3B-A0.5B-mla"], ["configs/moe/16B-A2.4B.toml"]])
    diagnostics_freq: int = 5
    disk_probe_bytes: int = DISK_PROBE_BYTES

    def __post_init__(self) -> None:
        if self.dry_run:
            self.steps, self.warmup = 5, 1
            self.dense, self.drill = "configs/dense/debug.toml", ["configs/dense/debug.toml"]
            self.moe = ["configs/moe/debug_mla.toml"]
            self.inspected = [["configs/dense/debug.toml"], ["configs/moe/debug.toml"], ["configs/moe/debug_mla.toml"]]
            self.diagnostics_freq = 3  # measured at 1 and 3; step 5 clean
            self.disk_probe_bytes = 2**24

    def budget(self, name: str) -> int:
        """Seconds for check `name`: the estimate on a GPU; in a dry run DRY_RUN_BUDGET_S."""
        return DRY_RUN_BUDGET_S if self.dry_run else (BUDGETS.get(name) or MULTI_GPU_BUDGET).seconds

    def common(self, steps: int | None = None) -> list[str]:
        """Trainer flags every training run shares: one GPU's own batch, a metrics line per
        step, nothing saved or validated, the lr warmed up over the timing's warm-up."""
        flags = ["--nproc", "1", "--training.steps", str(steps or self.steps), "--training.global_batch_size", "-1",
                 "--training.local_batch_size", "8", "--metrics.log_freq", "1",
                 "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
                 "--checkpoint.enable", "false", "--lr_scheduler.warmup_steps", str(self.warmup),
                 "--gamma.diagnostics.enable", "false"]
        if self.dry_run:
            flags += ["--compile.enable", "false", "--training.seq_len", "128", "--training.local_batch_size", "2",
                      "--quantize.linear.float8.emulate", "true"]
        return flags


def read_metrics(dump: Path) -> list[dict]:
    path = dump / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def last_wins(argv: list[str]) -> list[str]:
    """A command line whose `--section.key value` flags are each given once: a later one
    (a check's own setting over the shared ones) takes the first one's place. The trainer's
    command refuses a key typed twice."""
    items: list[list[str]] = []
    where: dict[str, int] = {}
    i = 0
    while i < len(argv):
        key, eq, _ = argv[i].partition("=")
        if argv[i].startswith("--") and "." in key:
            pair = argv[i:i + (1 if eq else 2)]
            if key in where:
                items[where[key]] = pair
            else:
                where[key] = len(items)
                items.append(pair)
            i += len(pair)
        else:
            items.append([argv[i]])
            i += 1
    return [token for item in items for token in item]


def train(setup: Setup, name: str, argv: list[str], deadline: float, on_poll=None) -> Run:
    """One training run (its dump folder `<logs>/runs/<name>`), killed at `deadline`; a run
    cut off leaves `<logs>/<name>.timed_out`, so no other check reads it as finished."""
    argv = last_wins(argv)
    dump = setup.logs / "runs" / name
    env = {**os.environ, "TORCH_LOGS": "graph_breaks,recompiles"}
    marker = setup.logs / f"{name}.timed_out"
    marker.unlink(missing_ok=True)
    done = run_until([*argv, "--job.dump_folder", str(dump)], setup.logs / f"{name}.log", deadline, env=env,
                     cwd=REPO, on_poll=on_poll)
    if done.timed_out:
        marker.touch()
    return Run(read_metrics(dump), done.output, done.code, done.seconds)


def preload() -> None:
    """What the checks import in the driver's process (the configs, the model registry, the
    checkpoint folders), imported before any check's timed window starts."""
    import importlib

    for module in ("torch", "gamma_titan.files", "gamma_titan.training.checkpoint_folders"):
        importlib.import_module(module)
    resolve(["configs/dense/debug.toml"])


def resolve(argv: list[str]):
    """The model args a config (and flags) gives, without building anything."""
    from gamma_titan.config import load_job_config
    from gamma_titan.training.train_spec import resolve_model

    config_file, *flags = argv
    return resolve_model(load_job_config(["--job.config_file", str(REPO / config_file), *flags]))


def first_step_loss(argv: list[str]) -> float | None:
    """Step 1's loss at the config's γ-init, from the shapes alone: the output head's weights
    are N(0, d^-2γ) (γ of the `output` group) and the final RMSNorm gives every token a
    vector of RMS 1, so the logits are N(0, σ² = d^(1-2γ)) and the cross entropy is
    ln V + σ²/2. None where σ² is not small (γ near 0.5), which the expansion needs."""
    _, args = resolve(argv)
    variance = args.dim ** (1 - 2 * args.init.rate_for("output"))
    return math.log(args.vocab_size) + variance / 2 if variance <= 0.05 else None


# --- inspect: kernels, every MoE config ----------------------------------------------------------

def inspect_all(setup: Setup, deadline: float) -> list[tuple[str, Verdict]]:
    """kernels + inspect_moe: `gamma-titan inspect --json` of every config in one process
    (`python tools/gpu_check.py --inspect ...`, one JSON line per config)."""
    specs = [" ".join(argv) for argv in setup.inspected]
    command = [sys.executable, str(REPO / "tools" / "gpu_check.py"), "--inspect", *specs]
    done = run_until(command, setup.logs / "inspect.log", deadline, cwd=REPO)
    reports = {}
    for line in done.output.splitlines():
        if line.startswith('{"inspected"'):
            item = json.loads(line)
            reports[item["inspected"]] = item
    kernels, failures = {}, []
    for spec in specs:
        item = reports.get(spec)
        label = label_of(spec)
        if item is None or "error" in item:
            failures.append(f"{label}: {item['error'] if item else ('timeout' if done.timed_out else 'no report')}")
            continue
        for line in item["attention_kernels"]:
            kind = re.search(r"attention (\w+): SDPA kernel (\w+)", line)
            kernels[f"{label} {kind.group(1)}"] = kind.group(2)
    moe = [s for s in specs if "configs/moe/" in s]
    moe_failed = [f for f in failures if f.startswith("moe/")]
    inspect = Verdict(not moe_failed, f"{len(moe) - len(moe_failed)}/{len(moe)} MoE configs inspected",
                      {"inspected": [label_of(s) for s in specs if s in reports and "error" not in reports[s]]},
                      moe_failed)
    if moe_failed:
        inspect.figure = "; ".join(moe_failed) + " | " + inspect.figure
    return [("kernels", judge_kernels(kernels, failures, on_gpu=not setup.dry_run)), ("inspect_moe", inspect)]


def label_of(spec: str) -> str:
    config, *rest = spec.split()
    flavor = rest[rest.index("--model.flavor") + 1] if "--model.flavor" in rest else Path(config).stem
    return f"{Path(config).parent.name}/{flavor}"


def inspect_main(specs: list[str]) -> int:
    """`gpu_check.py --inspect SPEC...`: `gamma-titan inspect SPEC --json` for each, in this
    process (one start-up for all), 2 layers deep; prints {"inspected": SPEC, ...report}."""
    import contextlib
    import io

    from gamma_titan.cli import main as cli_main

    for spec in specs:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                cli_main(["inspect", *spec.split(), "--json", "--model_args.n_layers", "2"])
        except SystemExit as stop:
            if stop.code not in (0, None):
                print(json.dumps({"inspected": spec, "error": f"exit {stop.code}: {out.getvalue()[-300:]}"}), flush=True)
                continue
        except Exception as e:  # noqa: BLE001  (reported as this config's failure)
            print(json.dumps({"inspected": spec, "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
            continue
        report = json.loads(out.getvalue().strip().splitlines()[-1])
        print(json.dumps({"inspected": spec, "attention_kernels": report["attention_kernels"]}), flush=True)
    return 0


# --- the runs -------------------------------------------------------------------------------------

#: gamma_dense configured as TorchTitan's llama3 computes: the same arithmetic.
LIKE_LLAMA3 = ["--gamma.init_rate", "0.5", "--gamma.norm_eps", "1e-5", "--gamma.attention_gate", "none"]
#: float8 linears, TorchTitan's tensorwise recipe. The dry run's emulated float8 takes no
#: recipe (TorchTitan builds a recipe's config without `emulate`; preflight refuses both).
FLOAT8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "tensorwise"]
FLOAT8_EMULATED = ["--model.converters", "quantize.linear.float8"]
#: gamma_moe configured as TorchTitan's deepseek_v3 computes: no gate, TorchTitan's init and
#: ε, no sequence-wise balance loss (deepseek_v3 balances by the expert bias alone).
LIKE_DEEPSEEK_V3 = ["--gamma.init_rate", "0.5", "--gamma.norm_eps", "1e-5", "--gamma.attention_gate", "none",
                    "--model_args.aux_loss_coeff", "0"]


def compiled_runs(setup: Setup) -> list[tuple[str, list[str]]]:
    """(run name, command) of every compiled training run, in the order the checks run them."""
    common = setup.common()
    # tools/bench/gpu.py trains in its own process (no torchrun): no --nproc
    bench_flags = ["--job.config_file", str(REPO / setup.dense), *common[2:], *LIKE_LLAMA3]
    config, *flavor = setup.moe
    moe_bench_flags = ["--job.config_file", str(REPO / config), *flavor, *common[2:], *LIKE_DEEPSEEK_V3]
    return [
        ("dense_default", [*CLI, "train", setup.dense, *common, "--gamma.diagnostics.enable", "true",
                           "--gamma.diagnostics.freq", str(setup.diagnostics_freq)]),
        ("dense_float8", [*CLI, "train", setup.dense, *common, *(FLOAT8_EMULATED if setup.dry_run else FLOAT8)]),
        ("moe_mla_bf16", [*CLI, "train", config, *flavor, *common]),
        ("dense_like_llama3", [*CLI, "train", setup.dense, *common, *LIKE_LLAMA3]),
        ("dense_llama3", [sys.executable, str(BENCH_GPU), "--run-variant", "llama3_bench", *bench_flags]),
        ("moe_like_deepseek_v3", [*CLI, "train", config, *flavor, *common, *LIKE_DEEPSEEK_V3]),
        ("moe_deepseek_v3", [sys.executable, str(BENCH_GPU), "--run-variant", "deepseek_v3_bench",
                             *moe_bench_flags]),
    ]


def run_named(setup: Setup, name: str, deadline: float) -> Run:
    return train(setup, name, dict(compiled_runs(setup))[name], deadline)


def saved_run(setup: Setup, name: str) -> Run | None:
    """A run an earlier check left in the logs (also one of an earlier, resumed gpu_check);
    None where it is missing or was cut off."""
    log = setup.logs / f"{name}.log"
    if not log.exists() or (setup.logs / f"{name}.timed_out").exists():
        return None
    return Run(read_metrics(setup.logs / "runs" / name), log.read_text(errors="replace"))


# --- dense: the compiled bf16 step, against TorchTitan, the diagnostics ----------------------------

def dense_bf16(setup: Setup, deadline: float) -> Verdict:
    """gamma_dense at the default knobs: MFU floor, step 1 at the init's loss, no graph break."""
    run = run_named(setup, "dense_default", deadline)
    return judge_dense(run, setup.steps, setup.warmup, first_step_loss([setup.dense]), compiled=not setup.dry_run,
                       mfu_floor=0.0 if setup.dry_run else MFU_FLOOR_PERCENT)  # CPU: no peak FLOPs


def gate_flop_share(setup: Setup) -> float:
    seq = 128 if setup.dry_run else 2048
    _, gated = resolve([setup.dense])
    _, plain = resolve([setup.dense, "--gamma.attention_gate", "none"])
    return 1 - plain.flops_per_token(seq) / gated.flops_per_token(seq)


def dense_vs_titan(setup: Setup, deadline: float) -> Verdict:
    """Like for like against TorchTitan's llama3 (tokens/s); the gate's cost from
    dense_bf16's run where it is there."""
    ours = run_named(setup, "dense_like_llama3", deadline)
    titan = run_named(setup, "dense_llama3", deadline)
    return judge_vs_titan(ours, titan, saved_run(setup, "dense_default"), setup.steps, setup.warmup,
                          gate_flop_share(setup), compiled=not setup.dry_run,
                          min_speed=0.0 if setup.dry_run else MIN_SPEED_VS_TITAN)  # CPU: noisy, printed only


def diagnostics(setup: Setup) -> Verdict:
    """From dense_bf16's run with its default knobs, which measured at step 1 and every
    `diagnostics_freq` steps; not measured (SKIP) where that run is missing."""
    default = saved_run(setup, "dense_default")
    if default is None:
        return Verdict(None, "not measured: dense_bf16 left no finished run", {"skipped": True})
    return judge_diagnostics(default, setup.warmup, setup.diagnostics_freq)


# --- float8 and MoE ------------------------------------------------------------------------------------

#: Linear layers that must stay in high precision, by the end of their name.
HIGH_PRECISION_SUFFIXES = ("output", "router.gate")


def expected_float8_layers(argv: list[str]) -> tuple[int, set[str], set[str]]:
    """Every nn.Linear of the model (built on the meta device) is converted but the output
    head, the router and a headwise gate (n_heads columns): count, patterns, kept patterns."""
    import torch

    spec, args = resolve(argv)
    with torch.device("meta"):
        model = spec.model_cls(args)
    converted, kept = {}, set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            pattern = re.sub(r"layers\.\d+\.", "layers.*.", name)
            headwise = name.endswith("gate_proj") and module.out_features == args.n_heads
            if name.endswith(HIGH_PRECISION_SUFFIXES) or headwise:
                kept.add(pattern)
            else:
                converted[pattern] = converted.get(pattern, 0) + 1
    return sum(converted.values()), set(converted), kept


def dense_float8(setup: Setup, deadline: float) -> Verdict:
    """Its own run judged alone; against dense_bf16's run (losses, tokens/s) where it is there."""
    run = run_named(setup, "dense_float8", deadline)
    return judge_float8(run, saved_run(setup, "dense_default"), setup.steps, setup.warmup,
                        expected_float8_layers([setup.dense]), compiled=not setup.dry_run)


def moe_mla_bf16(setup: Setup, deadline: float) -> Verdict:
    run = run_named(setup, "moe_mla_bf16", deadline)
    return judge_moe(run, setup.steps, first_step_loss(setup.moe), compiled=not setup.dry_run,
                     min_drop=DRY_RUN_MIN_LOSS_DROP if setup.dry_run else MIN_LOSS_DROP, warmup=setup.warmup)


def moe_vs_titan(setup: Setup, deadline: float) -> Verdict:
    """Like for like against TorchTitan's deepseek_v3 at the same MLA shape (tokens/s)."""
    ours = run_named(setup, "moe_like_deepseek_v3", deadline)
    titan = run_named(setup, "moe_deepseek_v3", deadline)
    return judge_vs_titan(ours, titan, None, setup.steps, setup.warmup, 0.0, compiled=not setup.dry_run,
                          min_speed=0.0 if setup.dry_run else MIN_SPEED_VS_TITAN,  # CPU: noisy, printed only
                          names=("gamma_moe (like deepseek_v3)", "deepseek_v3"))


#: The debug MoE's loss over the dry run's 5 steps (lr still warming up): it fell 4.1% in 4
#: steps on this machine.
DRY_RUN_MIN_LOSS_DROP = 0.02


# --- SIGTERM and resume ----------------------------------------------------------------------------

RESUME_STEP = 3  # the interval checkpoint the resumed run starts from


def disk_bandwidth(folder: Path, size: int) -> float:
    """Bytes a second of writing `size` bytes into `folder` and syncing them to the disk."""
    probe = folder / "disk_probe.bin"
    block = os.urandom(1 << 20)
    started = time.monotonic()
    with open(probe, "wb") as f:
        for _ in range(max(1, size // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.monotonic() - started
    probe.unlink()
    return max(1, size // len(block)) * len(block) / seconds


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def sigterm_drill(setup: Setup, deadline: float) -> Verdict:
    """The disk first: DISK_PROBE_BYTES written and synced, its bandwidth measured, and room
    for the drill's saves checked. Then SIGTERM to `gamma-titan train` once step
    RESUME_STEP + 1 is logged (checkpoints every RESUME_STEP steps, eager): it must save the
    step in progress, within what the measured disk allows, and exit. A second run starts
    from the first one's step-RESUME_STEP checkpoint (hard-linked into its own folder:
    nothing of the first run is touched) and trains one step: the same loss."""
    from gamma_titan.files import step_folder
    from gamma_titan.training.checkpoint_folders import checkpoint_steps

    setup.logs.mkdir(parents=True, exist_ok=True)
    bandwidth = disk_bandwidth(setup.logs, setup.disk_probe_bytes)
    need = 0 if setup.dry_run else (3 + 1 / 3) * DRILL_CHECKPOINT_BYTES
    free = shutil.disk_usage(setup.logs).free
    if free < need:
        return Verdict(False, f"{free / 1e9:.1f} GB free in {setup.logs}, the drill writes {need / 1e9:.1f} GB",
                       {"disk_bytes_per_s": bandwidth, "free_bytes": free}, ["no room"])
    config, *flags = setup.drill
    base = [*CLI, "train", config, *flags, *setup.common(steps=1000), "--compile.enable", "false",
            "--checkpoint.enable", "true", "--checkpoint.interval", str(RESUME_STEP),
            "--checkpoint.keep_latest_k", "0", "--checkpoint.last_save_model_only", "false"]
    first_dump = setup.logs / "runs" / "sigterm_drill"
    signalled: dict[str, float] = {}

    def signal_after_steps(proc) -> bool:
        if len(read_metrics(first_dump)) > RESUME_STEP:
            signalled["at"] = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            return True
        return False

    first = train(setup, "sigterm_drill", base, deadline, on_poll=signal_after_steps)
    stop_seconds = (time.monotonic() - signalled["at"]) if "at" in signalled and first.code is not None else None
    saved, incomplete = checkpoint_steps(first_dump / "checkpoint")
    times = re.findall(r"Finished saving the checkpoint.*?in ([\d.]+) seconds", first.log)
    last_bytes = folder_bytes(first_dump / "checkpoint" / step_folder(saved[-1])) if saved else 0
    resumed_dump = setup.logs / "runs" / "sigterm_drill_resumed"
    source = first_dump / "checkpoint" / step_folder(RESUME_STEP)
    resumed = Run(code=None)
    if source.is_dir():
        link_tree(source, resumed_dump / "checkpoint" / source.name)
        argv = [a for a in base]
        argv[argv.index("--training.steps") + 1] = str(RESUME_STEP + 1)
        argv[argv.index("--checkpoint.last_save_model_only") + 1] = "true"
        resumed = train(setup, "sigterm_drill_resumed", argv, deadline)
    return judge_drill(first, resumed, RESUME_STEP, saved, incomplete, float(times[-1]) if times else None,
                       last_bytes, bandwidth, stop_seconds)


def link_tree(source: Path, dest: Path) -> None:
    """A copy of `source` made of hard links (no bytes written; the original stays as it is)."""
    for path in sorted(source.rglob("*")):
        target = dest / path.relative_to(source)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)


# --- layouts of several GPUs ------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """A parallel layout of one of TorchTitan's models with the knobs, against one GPU."""

    config: str
    gpus: int
    flags: tuple[str, ...]  # the layout's [parallelism] degrees
    local_batch: int  # of the layout's ranks, for GLOBAL_BATCH sequences a step
    settings: tuple[str, ...] = ()


#: Sequences a step in every layout check.
GLOBAL_BATCH = 16
#: bf16 throughout (`training.dtype`): TorchTitan applies mixed precision only under FSDP, and
#: neither its context parallelism nor DTensor SDPA has an fp32 kernel (cuDNN, flash: bf16).
LAYOUTS = {
    "titan_cp2": Layout("configs/titan/llama3_debug.toml", 2,
                        ("--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
                        GLOBAL_BATCH),
    # our families: ring attention over head-tail chunks, rotary by global position; MoE
    # with its sequence-wise balance loss summed over the 2 ranks, MLA's padded head dims
    "dense_cp2": Layout("configs/dense/debug.toml", 2,
                        ("--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
                        GLOBAL_BATCH),
    "moe_cp2": Layout("configs/moe/debug.toml", 2,
                      ("--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
                      GLOBAL_BATCH, ("--optimizer.lr", "3e-4")),
    "moe_mla_cp2": Layout("configs/moe/debug_mla.toml", 2,
                          ("--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                           "1"), GLOBAL_BATCH, ("--optimizer.lr", "3e-4")),
    "qwen3_tp2": Layout("configs/titan/qwen3_debug.toml", 2,
                        ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
                        GLOBAL_BATCH),
    # expert parallelism borrows the 2 data-parallel ranks; lr 3e-4 and round-robin routing
    # keep 20 steps calm (tests/titan_cases.py)
    "deepseek_ep2": Layout("configs/titan/deepseek_v3_debug.toml", 2,
                           ("--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"),
                           GLOBAL_BATCH // 2, ("--optimizer.lr", "3e-4", "--debug.moe_force_load_balance", "true")),
}


def layout_check(setup: Setup, name: str, deadline: float) -> Verdict:
    """The layout against one GPU on the same global batch, with the tolerance measured by
    one GPU summing that batch in two micro-batches (judges.judge_parallel)."""
    layout = LAYOUTS[name]
    if setup.dry_run or setup.gpus < layout.gpus:
        found = "a CPU" if setup.dry_run else f"{setup.gpus} GPU"
        return Verdict(None, f"needs {layout.gpus} CUDA devices, {found} here", {"skipped": True})
    common = [*setup.common(), "--training.global_batch_size", str(GLOBAL_BATCH), "--training.dtype", "bfloat16",
              "--training.mixed_precision_param", "bfloat16", *layout.settings]

    def run(tag: str, nproc: int, local: int, *flags: str) -> Run:
        argv = [*CLI, "train", layout.config, *common, "--training.local_batch_size", str(local), *flags]
        argv[argv.index("--nproc") + 1] = str(nproc)
        return train(setup, f"{name}_{tag}", argv, deadline)

    reference = run("1gpu", 1, GLOBAL_BATCH)
    reordered = run("1gpu_2micro", 1, GLOBAL_BATCH // 2)
    parallel = run(f"{layout.gpus}gpu", layout.gpus, layout.local_batch, *layout.flags)
    return judge_parallel(reference, reordered, parallel, setup.steps)
