"""The branches a CUDA host takes, forced on the CPU.

Every decision that depends on the machine (is a GPU there? which dtype do the blocks
see?) is taken here the way a GPU node takes it, so that a first cluster run does not
meet a path no test has walked.
"""

import json

import pytest
import torch

import gamma_titan  # noqa: F401
from helpers import REPO
from gamma_titan.inspect_model import inspect_model
from gamma_titan.models.moe import GammaMoE, moe_flavors
from gamma_titan.models import TRAIN_SPECS

MOE_SPEC = TRAIN_SPECS["gamma_moe"]
#: Every MoE flavor up to 3B total parameters.
MOE_FLAVORS = ["debug", "debug_mla", "tiny", "tiny-2x", "1.5B-A0.25B", "1.5B-A0.25B-mla", "3B-A0.5B",
               "3B-A0.5B-mla"]


@pytest.fixture
def cuda_host(monkeypatch):
    """What the code sees on a GPU node: CUDA is available (the tensors stay on the CPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def block_sized(flavor: str):
    """The flavor's blocks at full size (heads, experts, widths), but one dense and one MoE
    block and a small vocabulary, so that a 3B flavor runs in seconds."""
    args = moe_flavors[flavor]
    if args.n_layers > 4:
        args.n_layers, args.vocab_size = args.n_dense_layers + 1, 512
    args.init.seed = 0
    args.check()
    return args


def moe_numbers(flavor: str) -> tuple[dict, torch.Tensor | None]:
    """inspect's report (a forward, one block at a time) and, for the small flavors, the
    logits of a forward of the whole model as the trainer builds it."""
    args = block_sized(flavor)
    report = inspect_model(MOE_SPEC, args, 64, seed=0)
    if report["n_params"] > 50e6:
        return report, None
    torch.manual_seed(0)
    model = GammaMoE(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return report, model(tokens)


@pytest.mark.parametrize("flavor", MOE_FLAVORS)
def test_moe_runs_on_the_cpu_of_a_gpu_host(flavor, monkeypatch):
    """Hazard 1: the expert kernel is chosen per call from the tensors' device, not from
    torch.cuda.is_available() when the model is built."""
    report, logits = moe_numbers(flavor)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        forced_report, forced_logits = moe_numbers(flavor)
    assert forced_report == report
    assert (logits is None) == (forced_logits is None)
    assert logits is None or torch.equal(forced_logits, logits)


def test_inspect_cli_on_a_gpu_host(cuda_host, capsys):
    from gamma_titan.cli import main

    for config in ("debug", "debug_mla"):
        with pytest.raises(SystemExit) as done:
            main(["inspect", str(REPO / "configs" / "moe" / f"{config}.toml"), "--json"])
        assert done.value.code == 0
        report = json.loads(capsys.readouterr().out)
        assert report["model"] == "GammaMoE" and report["residual_flow_ratio"] > 0


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of one rank in this process (FSDP2 needs one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_rotary_cache_reaches_blocks_in_fp32_under_bf16_fsdp(world_of_one):
    """Hazard 11: FSDP2 casts the floating-point arguments of a wrapped block to the
    parameter dtype; the rotary cache must reach the attention unrounded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp

    from helpers import small_args
    from gamma_titan.models.dense import GammaDense

    torch.manual_seed(0)
    args = small_args(n_layers=2, max_seq_len=4096)
    model = GammaDense(args)
    model.init_weights()
    reference = model.rope.clone()
    apply_fsdp(model, init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",)), param_dtype=torch.bfloat16,
               reduce_dtype=torch.float32, pp_enabled=False)
    seen = []
    model.layers["1"].attention.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[1]))
    tokens = torch.randint(0, args.vocab_size, (1, 4096))
    with torch.no_grad():
        assert model(tokens).dtype == torch.bfloat16  # the blocks did run in bf16
    [rope] = seen
    assert (torch.view_as_real(rope) if rope.is_complex() else rope).dtype == torch.float32
    assert torch.equal(rope, reference[:4096])


def test_startup_summary_does_not_draw_the_model_on_a_gpu_run(monkeypatch):
    """Hazard 12: rank 0 logs the model at start-up; on a GPU run it must not draw every
    weight on its CPU first (the other ranks wait at the first collective meanwhile)."""
    import gamma_titan.inspect_model as inspect_module
    from gamma_titan.config import load_job_config
    from gamma_titan.training.main import startup_summary
    from gamma_titan.training.train_spec import resolve_model

    config = load_job_config(["--job.config_file", str(REPO / "configs" / "dense" / "1.5B.toml")])
    spec, args = resolve_model(config)

    def no_drawing(*args, **kwargs):
        raise AssertionError("the startup summary materialised weights on a GPU run")

    monkeypatch.setattr(inspect_module, "forward_at_init", no_drawing)
    # the kernel report asks PyTorch's CUDA checks with tensors on the GPU: not here
    monkeypatch.setattr("gamma_titan.training.main.attention_kernels", lambda *a: ["attention mha: SDPA kernel (stub)"])
    text = startup_summary(spec, args, config, "cuda")
    assert "1,5" in text.splitlines()[0] and "skipped on a GPU run" in text
    assert "tokens per step: 1,048,576" in text and "attention mha: SDPA kernel (stub)" in text
    monkeypatch.undo()
    debug = load_job_config(["--job.config_file", str(REPO / "configs" / "dense" / "debug.toml")])
    spec, args = resolve_model(debug)
    text = startup_summary(spec, args, debug, "cpu")
    assert "residual-flow ratio" in text and "attention mha: SDPA kernel flash_cpu" in text


def test_float8_on_an_sm90_host_needs_no_emulation(cuda_host, monkeypatch, builtin_assets):
    """The pre-flight check takes the GPU's side: real float8 (not emulated) with compile."""
    from gamma_titan.config import load_job_config
    from gamma_titan.training.preflight import preflight

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    config = load_job_config(["--job.config_file", str(REPO / "configs" / "dense" / "1.5B.toml"),
                              "--model.converters", "quantize.linear.float8"])
    preflight(config, world_size=8, local_world_size=8)
    assert config.compile.enable and not config.quantize.linear.float8.emulate
    assert "output" in config.quantize.linear.float8.filter_fqns


def test_torchtitans_gpu_only_layouts_pass_pre_flight_on_a_gpu_host(cuda_host, monkeypatch, builtin_assets):
    """What pre-flight refuses on a CPU (qwen3's TP, which shards SDPA's inputs; TorchTitan's
    expert parallelism, whose token permutation is a Triton kernel) it lets through where
    CUDA is: the check is the machine's, not the model's."""
    from gamma_titan.config import load_job_config
    from gamma_titan.training.preflight import preflight

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # H100
    for config_file, overrides in (("qwen3_debug.toml", ["--parallelism.tensor_parallel_degree", "2",
                                                         "--training.dtype", "bfloat16"]),
                                   ("qwen3_debug.toml", ["--model.flavor", "debugmodel_moe",
                                                         "--parallelism.expert_parallel_degree", "2"]),
                                   ("deepseek_v3_debug.toml", ["--parallelism.expert_parallel_degree", "2"])):
        config = load_job_config(["--job.config_file", str(REPO / "configs" / "titan" / config_file), *overrides])
        preflight(config, world_size=2, local_world_size=2)
        p = config.parallelism
        assert (p.tensor_parallel_degree, p.expert_parallel_degree) == (
            (2, 1) if "--parallelism.tensor_parallel_degree" in overrides else (1, 2))


def test_qwen3_tensor_parallel_in_float32_is_refused_on_a_gpu(cuda_host, monkeypatch, builtin_assets):
    """TorchTitan's qwen3 TP plan hands SDPA DTensors, and DTensor SDPA has no float32
    kernel. Without FSDP, TP trains in training.dtype; with it, in mixed_precision_param:
    float32 either way is refused in one line, bf16 either way passes."""
    from gamma_titan.config import load_job_config
    from gamma_titan.errors import ConfigError
    from gamma_titan.training.preflight import preflight

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    # the MoE flavor: the dense debug flavor ties its head to the embedding, which FSDP refuses (qwen3.py)
    qwen3 = ["--job.config_file", str(REPO / "configs" / "titan" / "qwen3_debug.toml"),
             "--model.flavor", "debugmodel_moe", "--parallelism.tensor_parallel_degree", "2"]
    for world, flags in ((2, []), (4, ["--training.mixed_precision_param", "float32"])):
        with pytest.raises(ConfigError, match="^parallelism.tensor_parallel_degree = 2: qwen3's tensor parallelism "
                                              "hands SDPA sharded inputs, which have no float32 kernel; train in bf16"):
            preflight(load_job_config([*qwen3, *flags]), world_size=world, local_world_size=world)
    for world, flags in ((2, ["--training.dtype", "bfloat16"]), (4, ["--training.mixed_precision_param", "bfloat16"])):
        preflight(load_job_config([*qwen3, *flags]), world_size=world, local_world_size=world)
    llama3 = ["--job.config_file", str(REPO / "configs" / "titan" / "llama3_debug.toml"),
              "--parallelism.tensor_parallel_degree", "2"]
    preflight(load_job_config(llama3), world_size=2, local_world_size=2)  # its plan hands SDPA local tensors
