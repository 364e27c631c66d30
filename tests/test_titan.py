"""The paper's knobs on TorchTitan's own models (gamma_titan/models/titan): without [gamma]
knobs TorchTitan's model and trainer give the same initial weights and losses bit for bit;
with them, every weight follows the γ rule, every RMSNorm has the ε, and the gate computes
what a naive reference computes."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from helpers import REPO
from gamma_titan.config import load_job_config
from gamma_titan.inspect_model import inspect_model, resolve_model

TITAN_CONFIGS = {"llama3": REPO / "configs" / "titan" / "llama3_debug.toml"}
REFERENCE = REPO / "tests" / "scripts" / "titan_reference.py"


def without_gamma_knobs(config, tmp_path):
    """The config with its [gamma] table (the three knobs) removed."""
    text = re.sub(r"\[gamma\]\n(.*\n)*?\n", "", config.read_text(), count=1)
    assert "init_rate" not in text and "attention_gate" not in text
    path = tmp_path / config.name
    path.write_text(text)
    return path


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", sorted(TITAN_CONFIGS))
def test_without_gamma_knobs_the_model_is_torchtitans_bit_for_bit(model, tmp_path, builtin_assets):
    """TorchTitan's Trainer with TorchTitan's own TrainSpec, against gamma_titan's trainer with
    the spec it registers under the same name: the same data (TorchTitan's text loader on a
    local file), tokenizer and config; equal initial weights and 5 losses, exactly."""
    from gamma_titan.data.builtin_corpus import TRAIN_FILE, ensure_builtin_corpus
    from gamma_titan.data.tokenizer import ensure_builtin_tokenizer

    config = without_gamma_knobs(TITAN_CONFIGS[model], tmp_path)
    common = ["--job.config_file", str(config), "--training.steps", "5", "--validation.enable", "false",
              "--gamma.diagnostics.enable", "false", "--metrics.enable_tensorboard", "false",
              "--training.dataset", "hf", "--training.dataset_path", str(ensure_builtin_corpus() / TRAIN_FILE),
              "--model.hf_assets_path", str(ensure_builtin_tokenizer(2048))]
    runs = {}
    for which in ("titan", "gamma"):
        out = tmp_path / f"{which}.pt"
        proc = subprocess.run([sys.executable, str(REFERENCE), str(out), which, *common,
                               "--job.dump_folder", str(tmp_path / which)],
                              capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        runs[which] = torch.load(out)
    titan, gamma = runs["titan"], runs["gamma"]
    assert titan["model_class"] != gamma["model_class"]  # two classes, one model
    assert sorted(titan["init"]) == sorted(gamma["init"])
    for name, tensor in titan["init"].items():
        assert torch.equal(tensor, gamma["init"][name]), name
    assert len(titan["losses"]) == 5 and titan["losses"] == gamma["losses"]


def titan_args(model: str, *overrides: str):
    config = load_job_config(["--job.config_file", str(TITAN_CONFIGS[model]), *overrides])
    return resolve_model(config)


@pytest.mark.parametrize("model", sorted(TITAN_CONFIGS))
def test_gamma_init_follows_the_rule_for_every_group(model, builtin_assets):
    """inspect's figures: every weight's std is d_in^(−γ) (the output head at its override),
    its fan-in the dimension it contracts; every RMSNorm, the final one included, has ε."""
    spec, args = titan_args(model, "--gamma.init_rate_overrides.output", "0.5")
    report = inspect_model(spec, args, 64, probe_len=64)
    groups = {row["group"] for row in report["params"]}
    assert groups == {"embedding", "attention", "gate", "ffn", "norm", "output"}
    for row in report["params"]:
        if row["group"] == "norm":
            assert row["fan_in"] is None and row["mean"] == 1.0
            continue
        gamma = 0.5 if row["group"] == "output" else 1.0
        assert row["fan_in"] == row["shape"][-1] and row["gamma"] == gamma
        assert row["target_std"] == pytest.approx(row["fan_in"] ** -gamma, rel=1e-12)
        assert row["std"] == pytest.approx(row["target_std"], rel=0.05), row["name"]
    # σ²(h) at the first norm is the embedding's d^(−2γ), far above ε = 1e-12
    assert report["hidden_var"] == pytest.approx(args.dim ** -2.0, rel=0.05) and not report["eps_dominated"]
    with torch.device("meta"):
        model_ = spec.model_cls(args)
    norms = [m for m in model_.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 2 * args.n_layers + 1 and all(m.eps == 1e-12 for m in norms)


@pytest.mark.parametrize("model", sorted(TITAN_CONFIGS))
def test_unset_knobs_keep_torchtitans_choices(model):
    """Each knob alone: ε only changes the norms, the gate only adds gate_proj, and
    without init_rate the init is TorchTitan's (inspect shows no γ)."""
    spec, args = titan_args(model, "--gamma.init_rate", "None", "--gamma.attention_gate", "None",
                            "--gamma.norm_eps", "None")
    assert args.init is None and args.attention_gate == "none" and args.norm_eps == 1e-5
    with torch.device("meta"):
        plain = spec.model_cls(args)
    assert not any("gate_proj" in n for n, _ in plain.named_parameters())
    assert {m.eps for m in plain.modules() if isinstance(m, torch.nn.RMSNorm)} == {1e-5}
    report = inspect_model(spec, args, 64, probe_len=64, measure=False)
    assert report["init_rate"] is None and all(r["gamma"] is None for r in report["params"])
    _, gated = titan_args(model, "--gamma.init_rate", "None", "--gamma.norm_eps", "None",
                          "--gamma.attention_gate", "headwise")
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in spec.model_cls(gated).named_parameters()}
    assert shapes["layers.0.attention.gate_proj.weight"] == (gated.n_heads, gated.dim)
    assert len(shapes) == len(dict(plain.named_parameters())) + gated.n_layers


def naive_gated_attention(attn, x: torch.Tensor, freqs_cis: torch.Tensor, gate: str) -> torch.Tensor:
    """Causal multi-head attention written out: RoPE as complex rotation of channel pairs,
    grouped KV heads repeated, softmax(q·k/√d) with a lower-triangular mask, then each head's
    output times sigmoid(x W_g) (one per head or per channel), then W_o."""
    bs, seq, _ = x.shape
    hd = attn.head_dim
    q = (x @ attn.wq.weight.T).view(bs, seq, -1, hd)
    k = (x @ attn.wk.weight.T).view(bs, seq, -1, hd)
    v = (x @ attn.wv.weight.T).view(bs, seq, -1, hd)

    def rotate(t):
        pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs_cis[:seq].view(1, seq, 1, -1)).flatten(3)

    q, k = rotate(q), rotate(k)
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", scores.softmax(dim=-1), v)
    width = hd if gate == "elementwise" else 1
    out = out * torch.sigmoid(x @ attn.gate_proj.weight.T).view(bs, seq, -1, width)
    return out.reshape(bs, seq, -1) @ attn.wo.weight.T


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_the_gate_equals_a_naive_reference_on_one_block(gate):
    """One block's attention of the llama3 debug model (16 heads, GQA off) with random
    weights: the gated forward against the reference above, and each head scaled exactly
    by its gate (a gate forced shut zeroes its head)."""
    spec, args = titan_args("llama3", "--gamma.attention_gate", gate)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    attn = model.layers["0"].attention
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.08)
    x = torch.randn(2, 24, args.dim)
    freqs = model.freqs_cis
    got = attn(x, freqs, None)
    torch.testing.assert_close(got, naive_gated_attention(attn, x, freqs, gate), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # close head 3's gate: its channels stop reaching wo
        width = args.dim // args.n_heads if gate == "elementwise" else 1
        attn.gate_proj.weight[3 * width:(3 + 1) * width] = 0
        attn.gate_proj.weight[3 * width:(3 + 1) * width, 0] = -1e4
        x[..., 0] = 1.0
        shut = attn(x, freqs, None)
        attn.wo.weight[:, 3 * (args.dim // args.n_heads):4 * (args.dim // args.n_heads)] = 0
        torch.testing.assert_close(shut, attn(x, freqs, None), rtol=0, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.parametrize("gate, hf_class", [("none", "LlamaForCausalLM"), ("elementwise", "GammaForCausalLM")])
def test_trained_llama3_converts_to_hf_with_the_same_logits(gate, hf_class, llama3_run, tmp_path):
    """A trained checkpoint: without the gate TorchTitan's mapping to transformers' Llama
    (ε = 1e-12 in its config), with it our GammaForCausalLM (Llama 3.1 RoPE scaling
    included); transformers' logits equal the model's to 1e-4."""
    transformers = pytest.importorskip("transformers")
    from gamma_titan.convert.dcp_io import load_model_state
    from gamma_titan.convert.hf import to_hf
    from gamma_titan.convert.model_record import read_model_record
    from gamma_titan.models import TRAIN_SPECS

    step = llama3_run("single" if gate == "elementwise" else "ungated") / "checkpoint" / "step-4"
    name, args, _ = read_model_record(step)
    assert name == "llama3" and args.attention_gate == gate and args.init.rate == 1.0
    model = TRAIN_SPECS["llama3"].model_cls(args)
    model.load_state_dict(load_model_state(step))
    folder = to_hf(step, tmp_path / "hf", progress=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [hf_class] and config["rms_norm_eps"] == 1e-12
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True)
    assert type(hf).__name__ == hf_class
    tokens = torch.randint(0, args.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.abs().max() > 1e-3  # trained logits, not a zero model
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def llama3_run(tmp_path_factory, builtin_assets):
    """`llama3_run(layout)`: the dump folder of 4 deterministic steps of llama3 debug with
    γ-init, ε and the gate, validated at steps 1 and 4, on one process ("single", which also
    checkpoints step 4), without the gate ("ungated", checkpointed too), or on 2 gloo ranks
    ("pp2": two pipeline stages, TorchTitan's pipelining function; "tp2": tensor parallel).
    Each runs once, when first asked for."""
    from helpers import QUIET, run_trainer

    checkpoint = ("--checkpoint.enable", "true", "--checkpoint.interval", "4")
    layouts = {"single": (1, checkpoint), "ungated": (1, (*checkpoint, "--gamma.attention_gate", "none")),
               "pp2": (2, ("--parallelism.pipeline_parallel_degree", "2", "--gamma.diagnostics.enable", "false")),
               "tp2": (2, ("--parallelism.tensor_parallel_degree", "2"))}
    dumps = {}

    def run(layout: str):
        if layout not in dumps:
            nproc, extra = layouts[layout]
            dump = tmp_path_factory.mktemp(layout) / "run"
            run_trainer(dump, *QUIET, "--training.steps", "4", "--debug.deterministic", "true",
                        "--validation.enable", "true", "--validation.freq", "4", "--validation.steps", "2",
                        *extra, nproc=nproc, config=TITAN_CONFIGS["llama3"])
            dumps[layout] = dump
        return dumps[layout]

    return run


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["pp2", "tp2"])
def test_two_ranks_match_one_process(layout, llama3_run):
    """Pipeline stages (the gradient rescaled to the loss mean, the loss from the last stage)
    and tensor parallelism (the gate column-parallel with the queries): the same losses,
    gradient norms and validation losses as one process, within the parallel tests'
    tolerance; under TP the diagnostics' sink score too."""
    # rtol 1e-4, as the parallel tests'; measured: losses equal to 1e-6, TP's gradient
    # norm (sums in another order) 2.8e-5 apart by step 4.
    from helpers import read_metrics

    single, other = read_metrics(llama3_run("single")), read_metrics(llama3_run(layout))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in other] == pytest.approx([r[key] for r in single], rel=1e-4, abs=0), key
    val = {name: [r["val_loss"] for r in runs if "val_loss" in r] for name, runs in (("1", single), ("2", other))}
    assert len(val["2"]) == 2 and val["2"] == pytest.approx(val["1"], rel=1e-4) and min(val["2"]) > 5
    if layout == "tp2":
        assert other[0]["gamma/sink_score/mean"] == pytest.approx(single[0]["gamma/sink_score/mean"], rel=1e-4)


def test_context_parallel_on_a_cpu_is_refused_in_one_line(builtin_assets):
    from gamma_titan.errors import ConfigError
    from gamma_titan.training.preflight import preflight

    config = load_job_config(["--job.config_file", str(TITAN_CONFIGS["llama3"]),
                              "--parallelism.context_parallel_degree", "2"])
    with pytest.raises(ConfigError) as err:
        preflight(config, world_size=2)
    assert str(err.value) == ("parallelism.context_parallel_degree = 2: context parallelism needs CUDA SDPA "
                              "kernels (PyTorch has no CPU ring attention); use 1 on this machine")
    config = load_job_config(["--job.config_file", str(TITAN_CONFIGS["llama3"]),
                              "--parallelism.pipeline_parallel_degree", "2"])
    with pytest.raises(ConfigError, match="gamma.diagnostics.enable = true needs parallelism.pipeline_parallel"):
        preflight(config, world_size=2)
