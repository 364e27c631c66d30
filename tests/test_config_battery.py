"""The config battery: bad inputs, each refused by the pre-flight checks with its one-line
message (naming the key and what is allowed), before any process group starts, and with
nothing written into job.dump_folder. This is what `gamma-titan train` and
`python -m gamma_titan.train` run first."""

import re

import pytest

from gamma_titan.config import load_job_config
from gamma_titan.errors import ConfigError
from gamma_titan.models import TRAIN_SPECS
from gamma_titan.training.preflight import preflight
from helpers import REPO

DENSE, MOE = "configs/dense/debug.toml", "configs/moe/debug.toml"
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--gamma.diagnostics.enable", "false")

# (config, overrides, world size, the message: exact, or a regex when it starts with "re:")
BATTERY = [
    (DENSE, ["--gamma.init_rate", "0"], 1, "gamma.init_rate = 0.0: must be a number in (0, 4]"),
    (DENSE, ["--gamma.init_rate", "5"], 1, "gamma.init_rate = 5.0: must be a number in (0, 4]"),
    (DENSE, ["--gamma.norm_eps", "-1"], 1, "gamma.norm_eps = -1.0: must be a number > 0"),
    (DENSE, ["--gamma.norm_eps", "0"], 1, "gamma.norm_eps = 0.0: must be a number > 0"),
    (DENSE, ["--gamma.attention_gate", "bogus"], 1,
     "gamma.attention_gate = 'bogus': allowed none, headwise, elementwise"),
    (DENSE, ["--gamma.attention_gate", "None"], 1,
     "gamma.attention_gate = 'None': allowed none, headwise, elementwise (None is not none: it would keep the "
     "config's value)"),
    (DENSE, ["--gamma.attention_gate=None"], 1,
     "gamma.attention_gate = 'None': allowed none, headwise, elementwise (None is not none: it would keep the "
     "config's value)"),
    (DENSE, ["--gamma.init_truncation", "-1"], 1, "gamma.init_truncation = -1.0: must be >= 0 (0 = no truncation)"),
    (DENSE, ["--gamma.init_rate_overrides.output", "9"], 1,
     "gamma.init_rate_overrides.output = 9.0: must be a number in (0, 4]"),
    (DENSE, ["--gamma.init_rate_overrides.output", "-1"], 1,
     "gamma.init_rate_overrides.output = -1.0: must be a number in (0, 4]"),
    (DENSE, ["--gamma.diagnostics.freq", "0"], 1, "gamma.diagnostics.freq = 0: must be an integer >= 1"),
    (DENSE, ["--gamma.diagnostics.cosine_rows", "1"], 1, "gamma.diagnostics.cosine_rows = 1: must be an integer >= 2"),
    (DENSE, ["--gamma.diagnostics.cosine_params", "nope.weight"], 1,
     "re:gamma.diagnostics.cosine_params: 'nope.weight' is not a weight matrix of gamma_dense; e.g. "),
    (DENSE, ["--gamma.data.seed", "-1"], 1, "gamma.data.seed = -1: must be an integer >= 0"),
    (DENSE, ["--gamma.data.on_exhausted", "forever"], 1,
     "gamma.data.on_exhausted = 'forever': allowed wrap, stop"),
    (DENSE, ["--gamma.reliability.max_skipped_steps", "-1"], 1,
     "gamma.reliability.max_skipped_steps = -1: must be an integer >= 0"),
    (DENSE, ["--gamma.reliability.stop_grace_seconds", "-2"], 1,
     "gamma.reliability.stop_grace_seconds = -2.0: must be a number > 0"),
    (DENSE, ["--model_args.n_heads", "3"], 1, "model_args.n_heads = 3 does not divide model_args.dim = 256"),
    (DENSE, ["--model_args.n_kv_heads", "3"], 1,
     "model_args.n_kv_heads = 3 must be a positive divisor of model_args.n_heads = 4"),
    (DENSE, ["--model_args.dim", "0"], 1, "model_args.dim = 0: must be a positive integer"),
    (DENSE, ["--model_args.vocab_size", "100"], 1,
     "re:model.hf_assets_path: the tokenizer at .* has 4096 tokens but model_args.vocab_size = 100; "
     "use vocab_size >= 4096$"),
    (DENSE, ["--model_args.n_routed_experts", "8"], 1, "model_args.n_routed_experts does not apply to model gamma_dense"),
    (DENSE, ["--model_args.rope_theta", "-1"], 1, "model_args.rope_theta = -1.0: must be > 0"),
    (DENSE, ["--model.flavor", "huge"], 1, "model.flavor = 'huge': allowed for gamma_dense: debug, tiny-32, tiny-48, tiny-64, "
     "tiny-96, tiny-128, gpu-256, gpu-384, gpu-512, gpu-768, 0.1B, 0.3B, 0.7B, 1.5B, 7B"),
    (DENSE, ["--model.name", "nonexistent"], 1, f"model.name = 'nonexistent': allowed {', '.join(TRAIN_SPECS)}"),
    (DENSE, ["--training.steps", "0"], 1, "training.steps = 0: must be an integer >= 1"),
    (DENSE, ["--training.steps", "1.5"], 1, "training.steps = '1.5': must be an integer"),
    (DENSE, ["--model_args.rope_theta=big"], 1, "model_args.rope_theta = 'big': must be a number"),
    (DENSE, ["--training.seq_len", "0"], 1, "training.seq_len = 0: must be an integer >= 1"),
    (DENSE, ["--training.local_batch_size", "0"], 1, "training.local_batch_size = 0: must be an integer >= 1"),
    (DENSE, ["--training.global_batch_size", "12"], 1, "training.global_batch_size = 12: must be -1 or a multiple "
     "of local_batch_size x data-parallel degree = 8 (the rest is gradient accumulation)"),
    (DENSE, ["--parallelism.tensor_parallel_degree", "3"], 3,
     "parallelism.tensor_parallel_degree = 3 must divide model_args.n_heads = 4 and the KV heads (2); use "
     "--parallelism.data_parallel_shard_degree 3 --parallelism.tensor_parallel_degree 1 (shard 3)"),
    (DENSE, ["--parallelism.data_parallel_shard_degree", "2"], 1,
     "parallelism.data_parallel_shard_degree = 2: the degrees multiply to 2 but the world size is 1; use "
     "--parallelism.data_parallel_shard_degree 1 (one rank)"),
    (DENSE, ["--parallelism.pipeline_parallel_degree", "2"], 2,
     "gamma.diagnostics.enable = true needs parallelism.pipeline_parallel_degree = 1 (the probe runs the whole "
     "model); set it false for pipeline-parallel runs"),
    (DENSE, [*PP2, "--parallelism.pipeline_parallel_schedule", "PipelineScheduleSingle"], 2,
     "parallelism.pipeline_parallel_schedule = 'PipelineScheduleSingle' runs the order in "
     "parallelism.pipeline_parallel_schedule_csv; set that file, or use 1F1B, GPipe, Interleaved1F1B, LoopedBFS, "
     "InterleavedZeroBubble or ZBVZeroBubble"),
    (DENSE, [*PP2, "--parallelism.pipeline_parallel_schedule", "DualPipeV"], 2,
     "parallelism.pipeline_parallel_schedule = 'DualPipeV' needs a GPU (torch's DualPipeV); on this machine use "
     "ZBVZeroBubble, the other V-shaped schedule"),
    (DENSE, [*PP2, "--parallelism.pipeline_parallel_layers_per_stage", "1"], 2,
     "parallelism.pipeline_parallel_schedule = '1F1B' runs one stage per rank, but the split has 3 per rank; use "
     "a looped schedule such as Interleaved1F1B, or 2 stages"),
    (DENSE, [*PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
             "--parallelism.pipeline_parallel_layers_per_stage", "1"], 2,
     "parallelism.pipeline_parallel_schedule = 'ZBVZeroBubble' runs two stages per rank (a V), but the split has "
     "3; make it 4 stages"),
    (DENSE, [*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
             "--parallelism.pipeline_parallel_layers_per_stage", "6"], 2,
     "parallelism.pipeline_parallel_degree = 2: must divide the 1 pipeline stages (module_fqns_per_model_part or "
     "pipeline_parallel_layers_per_stage)"),
    (DENSE, [*PP2, "--parallelism.pipeline_parallel_first_stage_less_layers", "9"], 2,
     "parallelism.pipeline_parallel_schedule = '1F1B' makes 2 stages, with pipeline_parallel_first_stage_less_layers "
     "= 9 and last_stage_less_layers = 1: input_weight (9) exceeds minimum layers per stage (7)."),
    (DENSE, [*PP2, "--parallelism.pipeline_parallel_microbatch_size", "8"], 2,
     "parallelism.pipeline_parallel_schedule = '1F1B' needs at least as many micro-batches as stages (2); "
     "training.local_batch_size / pipeline_parallel_microbatch_size = 8 / 8 = 1"),
    (DENSE, [*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--training.local_batch_size", "5",
             "--training.global_batch_size", "-1"], 2,
     "parallelism.pipeline_parallel_schedule = 'Interleaved1F1B' runs the micro-batches in rounds of 2: "
     "training.local_batch_size / pipeline_parallel_microbatch_size = 5 / 1 = 5 is not a multiple of 2"),
    (DENSE, [*PP2, "--validation.local_batch_size", "4"], 2,
     "validation.local_batch_size = 4: under pipeline parallelism the validator runs the training schedule's 8 "
     "micro-batches (training.local_batch_size / pipeline_parallel_microbatch_size); use a multiple of 8"),
    (MOE, [*PP2, "--parallelism.expert_parallel_degree", "2"], 2,
     "parallelism.expert_parallel_degree = 2 must divide the data-parallel shard degree (1) x context parallel "
     "degree (1); use --parallelism.expert_parallel_degree 1 (pp 2)"),
    (DENSE, ["--parallelism.expert_parallel_degree", "2"], 2,
     "parallelism.expert_parallel_degree = 2 applies to MoE models; gamma_dense has no experts; use "
     "--parallelism.expert_parallel_degree 1 (shard 2)"),
    (MOE, ["--parallelism.expert_parallel_degree", "3"], 2,  # the nearest degree that works, not 1
     "parallelism.expert_parallel_degree = 3 must divide the data-parallel shard degree (2) x context parallel "
     "degree (1); use --parallelism.expert_parallel_degree 2 (shard 2 x ep 2)"),
    (MOE, ["--parallelism.expert_parallel_degree", "3"], 3,
     "parallelism.expert_parallel_degree = 3 must divide model_args.n_routed_experts = 8; use "
     "--parallelism.expert_parallel_degree 1 (shard 3)"),
    (MOE, ["--model_args.top_k", "9"], 1, "model_args.top_k = 9 exceeds model_args.n_routed_experts = 8"),
    (MOE, ["--model_args.n_dense_layers", "4"], 1,
     "model_args.n_dense_layers = 4 leaves no MoE layer of model_args.n_layers = 4"),
    (MOE, ["--model_args.attention", "gqa"], 1, "model_args.attention = 'gqa': allowed mha, mla"),
    (MOE, ["--model_args.expert_kernel", "fast"], 1, "model_args.expert_kernel = 'fast': allowed auto, grouped, loop"),
    (MOE, ["--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode", "selective",
           "--activation_checkpoint.selective_ac_option", "op"], 2,
     "re:parallelism.expert_parallel_degree = 2 with activation_checkpoint.mode = \"selective\" and "
     "selective_ac_option = \"op\" fails at the first backward on torch 2\\.1[3-5].*; use --activation_checkpoint.mode "
     "full, a per-layer selective_ac_option such as 2, or expert_parallel_degree 1$"),
    (DENSE, ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "255"], 2,
     "training.seq_len = 255 must be divisible by parallelism.tensor_parallel_degree = 2 (sequence parallelism)"),
    (DENSE, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2",
             "--parallelism.data_parallel_shard_degree", "1"], 4,
     "parallelism.data_parallel_replicate_degree = 2 with data_parallel_shard_degree = 1 and replicate 2 x tp 2: "
     "replicas without shards are DDP, which takes no other parallelism; use "
     "--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 2 (shard 2 x tp 2)"),
    (MOE, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"], 4,
     "parallelism.expert_parallel_degree = 2 with tensor_parallel_degree = 2: parallelize_moe does not combine expert "
     "and tensor parallelism yet; use "
     "--parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 1 (shard 4 x ep 2)"),
    (MOE, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"], 2,
     "parallelism.expert_tensor_parallel_degree = 2 applies with expert parallelism only (expert_parallel_degree > "
     "1); use --parallelism.expert_tensor_parallel_degree 1 (tp 2)"),
    (MOE, ["--model_args.moe_hidden_dim", "129", "--parallelism.tensor_parallel_degree", "2"], 2,
     "parallelism.tensor_parallel_degree = 2 must divide model_args.moe_hidden_dim = 129; use "
     "--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1 (shard 2)"),
    (DENSE, ["--parallelism.context_parallel_degree", "2"], 2,
     "parallelism.context_parallel_degree = 2: context parallelism needs CUDA SDPA kernels (PyTorch has no CPU ring "
     "attention); use --parallelism.data_parallel_shard_degree 2 --parallelism.context_parallel_degree 1 (shard 2)"),
    (MOE, ["--parallelism.context_parallel_degree", "2"], 2,
     "parallelism.context_parallel_degree = 2: context parallelism needs CUDA SDPA kernels (PyTorch has no CPU ring "
     "attention); use --parallelism.data_parallel_shard_degree 2 --parallelism.context_parallel_degree 1 (shard 2)"),
    (DENSE, ["--training.dataset", "nosuch"], 1,
     "re:training.dataset: unknown dataset 'nosuch'; allowed: builtin, builtin_validation, .*memmap"),
    (DENSE, ["--training.dataset", "memmap", "--training.dataset_path", "/nonexistent"], 1,
     "training.dataset_path: /nonexistent does not exist"),
    (DENSE, ["--model.hf_assets_path", "/nonexistent"], 1,
     "model.hf_assets_path: '/nonexistent' does not exist; use \"builtin\" or a local folder with tokenizer.json"),
    (DENSE, ["--unknown.key", "1"], 1, "re:unknown option --unknown.key; allowed under \\(top level\\): .*gamma, job"),
    (DENSE, ["--training.bogus", "1"], 1, "re:unknown option --training.bogus; allowed under training: dataloader, "),
    (DENSE, ["--model.converters", "quantize.linear.float8"], 1,
     "quantize.linear.float8.emulate must be true without an SM89+ GPU (float8 runs emulated on this machine)"),
    # TorchTitan builds a recipe's torchao config by name and drops emulate (a CPU then ran
    # torch's reference float8 matmul, ~30 s a step of the debug model)
    (DENSE, ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "tensorwise",
             "--quantize.linear.float8.emulate", "true"], 1,
     "quantize.linear.float8.emulate = true does not apply with recipe_name = 'tensorwise' (TorchTitan builds the "
     "recipe's config without it); unset recipe_name for emulated tensorwise float8, or set emulate = false"),
    (DENSE, ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise"], 1,
     "quantize.linear.float8.recipe_name = 'rowwise' needs an SM89+ GPU (TorchTitan never emulates a recipe); on "
     "this machine unset it and set quantize.linear.float8.emulate = true (tensorwise float8, emulated)"),
    (DENSE, ["--checkpoint.interval", "0"], 1, "checkpoint.interval = 0: must be an integer >= 1"),
    (DENSE, ["--checkpoint.keep_latest_k", "1"], 1,
     "checkpoint.keep_latest_k = 1: must be 0 (keep all) or an integer >= 2 (TorchTitan keeps a spare while the "
     "newest may still be being written)"),
    (DENSE, ["--metrics.log_freq", "0"], 1, "metrics.log_freq = 0: must be an integer >= 1"),
    # what TorchTitan's CheckpointManager rejects only at the first load or the final save
    (DENSE, ["--checkpoint.enable", "true", "--checkpoint.last_save_in_hf", "true",
             "--checkpoint.last_save_model_only", "false"], 1,
     "checkpoint.last_save_in_hf = true needs checkpoint.last_save_model_only = true (the Hugging Face form holds "
     "the model only; TorchTitan would stop at the final save); or keep the full last save and run "
     "`gamma-titan convert to-hf` on it"),
    (DENSE, ["--checkpoint.enable", "true", "--checkpoint.initial_load_in_hf", "true",
             "--checkpoint.initial_load_model_only", "false"], 1,
     "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_model_only = true (a Hugging Face folder "
     "holds the model only)"),
    (DENSE, ["--checkpoint.enable", "true", "--checkpoint.initial_load_in_hf_quantized", "true"], 1,
     "checkpoint.initial_load_in_hf_quantized = true needs checkpoint.initial_load_in_hf = true"),
    (DENSE, ["--checkpoint.enable", "true", "--checkpoint.async_mode", "sometimes"], 1,
     "checkpoint.async_mode = 'sometimes': allowed disabled, async, async_with_pinned_mem"),
    (DENSE, ["--checkpoint.enable", "true", "--checkpoint.exclude_from_loading", "optimizer,weights"], 1,
     "checkpoint.exclude_from_loading = ['optimizer', 'weights']: allowed a list of model, optimizer, "
     "lr_scheduler, dataloader, train_state"),
    (DENSE, ["--checkpoint.enable", "true", "--checkpoint.initial_load_path", "/nonexistent/step-5"], 1,
     "checkpoint.initial_load_path = '/nonexistent/step-5': no such folder"),
    (DENSE, ["--validation.steps", "0"], 1, "validation steps must be positive or -1"),
    # TorchTitan's own keys (gamma_titan/config/titan_keys.py) and their combinations
    (DENSE, ["--optimizer.name", "adam"], 1, "optimizer.name = 'adam': allowed Adam, AdamW"),
    (DENSE, ["--optimizer.lr", "0"], 1, "optimizer.lr = 0.0: must be a number > 0"),
    (DENSE, ["--optimizer.beta2", "1"], 1, "optimizer.beta2 = 1.0: must be a number in [0, 1)"),
    (DENSE, ["--optimizer.weight_decay", "-0.1"], 1, "optimizer.weight_decay = -0.1: must be a number >= 0"),
    (DENSE, ["--lr_scheduler.min_lr_factor", "2"], 1, "lr_scheduler.min_lr_factor = 2.0: must be a number in [0, 1]"),
    (DENSE, ["--lr_scheduler.warmup_steps", "-1"], 1, "lr_scheduler.warmup_steps = -1: must be an integer >= 0"),
    (DENSE, ["--lr_scheduler.total_steps", "100"], 1,
     "lr_scheduler.total_steps = 100 is below training.steps = 200: past it the decay runs on (a linear or sqrt "
     "learning rate turns negative); use at least training.steps, or leave it unset"),
    (DENSE, ["--training.max_norm", "0"], 1, "training.max_norm = 0.0: must be a number > 0"),
    (DENSE, ["--training.global_batch_size", "0"], 1,
     "training.global_batch_size = 0: must be an integer >= 1, or -1 (-1: local_batch_size x data-parallel degree)"),
    (DENSE, ["--training.dataloader.prefetch_factor", "2"], 1,
     "training.dataloader.prefetch_factor = 2 needs training.dataloader.num_workers > 0 (PyTorch's DataLoader "
     "refuses it without worker processes)"),
    (DENSE, ["--parallelism.tensor_parallel_degree", "0"], 1,
     "parallelism.tensor_parallel_degree = 0: must be an integer >= 1"),
    (DENSE, ["--parallelism.data_parallel_shard_degree", "0"], 1,
     "parallelism.data_parallel_shard_degree = 0: must be an integer >= 1, or -1 (-1: the ranks left over)"),
    (DENSE, ["--parallelism.pipeline_parallel_schedule", "zigzag"], 1,
     "re:parallelism.pipeline_parallel_schedule = 'zigzag': 'zigzag' is not one of 1F1B, .*GPipe, "),
    (MOE, ["--parallelism.expert_tensor_parallel_degree", "2"], 1,
     "parallelism.expert_tensor_parallel_degree = 2: allowed 1 or tensor_parallel_degree (1)"),
    (DENSE, ["--activation_checkpoint.selective_ac_option", "0"], 1,
     "activation_checkpoint.selective_ac_option = '0': must be \"op\" or a layer interval \"1\", \"2\", ..."),
    (DENSE, ["--activation_checkpoint.mode", "memory_budget"], 1,
     "activation_checkpoint.mode = \"memory_budget\" needs compile.enable = true with \"model\" in "
     "compile.components (the budget is the compiler's partitioner's)"),
    (DENSE, ["--compile.backend", "inductr"], 1, "re:compile.backend = 'inductr': 'inductr' is not one of .*inductor"),
    (DENSE, ["--compile.components", "model,optimizer"], 1,
     "compile.components = ['model', 'optimizer']: allowed a list of model, loss"),
    (DENSE, ["--comm.trace_buf_size", "-1"], 1,
     "comm.trace_buf_size = -1: must be an integer >= 0 (0: no flight recorder)"),
    (DENSE, ["--debug.seed", "-3"], 1, "debug.seed = -3: must be an integer >= 0 (or unset)"),
    (DENSE, ["--profiling.enable_profiling", "true", "--profiling.profile_freq", "2"], 1,
     "profiling.profile_freq = 2 must be >= profiler_warmup + profiler_active = 4"),
    (DENSE, ["--experimental.custom_import", "no_such_package.models"], 1,
     "experimental.custom_import = 'no_such_package.models': no such module on this Python's path"),
    (DENSE, ["--fault_tolerance.enable", "true"], 1,  # torchft importable or not
     "fault_tolerance.enable = True: gamma_dense does not read it (only TorchTitan's experimental FTTrainer "
     "(torchtitan.experiments.ft) reads it; gamma-titan's trainer is TorchTitan's Trainer. A failed node is a restart "
     "from the newest checkpoint (README: Reliability)); leave it at TorchTitan's default (False)"),
    (DENSE, ["--fault_tolerance.replica_id", "1", "--fault_tolerance.group_size", "2"], 1,
     "re:fault_tolerance.replica_id = 1: gamma_dense does not read it \\(only TorchTitan's experimental FTTrainer"),
    (DENSE, ["--checkpoint.create_seed_checkpoint", "true", "--checkpoint.enable", "true"], 2,
     "checkpoint.create_seed_checkpoint = true runs on one process (TorchTitan's rule); this launch has 2"),
    (DENSE, ["--optimizer.early_step_in_backward", "true"], 1,
     "optimizer.early_step_in_backward = true cannot skip a non-finite step (it is taken inside backward); set "
     "gamma.reliability.on_nonfinite = \"stop\""),
    (DENSE, ["--model.converters", "quantize.linear.mx"], 1,
     "model.converters = ['quantize.linear.mx']: MX training needs an SM100 (Blackwell) GPU (TorchTitan's rule); "
     "use quantize.linear.float8"),
    ("configs/nonexistent.toml", [], 1, f"job.config_file: '{REPO / 'configs/nonexistent.toml'}' does not exist"),
]


def test_wandb_without_its_package_is_refused_in_one_line(monkeypatch, tmp_path):
    import gamma_titan.training.preflight as preflight_module

    real = preflight_module._importable
    monkeypatch.setattr(preflight_module, "_importable", lambda module: module != "wandb" and real(module))
    config = load_job_config(["--job.config_file", str(REPO / DENSE), "--job.dump_folder", str(tmp_path / "run"),
                              "--metrics.enable_wandb", "true"])
    with pytest.raises(ConfigError) as err:
        preflight(config, world_size=1)
    assert str(err.value) == ("metrics.enable_wandb: needs the wandb package, which this Python does not have; pip "
                              "install \".[wandb]\" (this project's extra), or leave metrics.enable_wandb at its default")


def test_the_battery_is_large():
    assert len(BATTERY) >= 25


@pytest.mark.parametrize("toml,overrides,world,message", BATTERY,
                         ids=[" ".join(b[1])[:60] or b[0] for b in BATTERY])
def test_bad_input_is_one_line_before_anything_starts(tmp_path, toml, overrides, world, message):
    import torch.distributed as dist

    dump = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        config = load_job_config(["--job.config_file", str(REPO / toml), "--job.dump_folder", str(dump), *overrides])
        preflight(config, world_size=world)
    text = str(err.value)
    assert "\n" not in text
    if message.startswith("re:"):
        assert re.match(message[3:], text), text
    else:
        assert text == message
    assert not dump.exists() and not dist.is_initialized()
