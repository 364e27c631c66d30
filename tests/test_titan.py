"""The paper's knobs on TorchTitan's own models (gamma_titan/models/titan), without training:
with them every weight follows the γ rule, every RMSNorm has the ε, and the gate computes
what a naive reference computes; unset, TorchTitan's choices stay; each converts to
Hugging Face (transformers' own class where it is exact, GammaForCausalLM otherwise) with
the same logits; what a CPU cannot run is refused in one line. The trainer runs are in
test_titan_bitwise.py and test_titan_runs.py."""

import math

import pytest
import torch

from titan_cases import TITAN_CONFIGS, titan_args, titan_own_model
from gamma_titan.config import load_job_config
from gamma_titan.inspect_model import inspect_model


@pytest.mark.parametrize("model, flavor", [("llama3", None), ("qwen3", None), ("qwen3", "debugmodel_moe"),
                                           ("deepseek_v3", None)])
def test_gamma_init_follows_the_rule_for_every_group(model, flavor, builtin_assets):
    """inspect's figures: every weight's std is d_in^(−γ) (the output head at its override),
    its fan-in the dimension it contracts (each routed expert's, for the stacked experts);
    every RMSNorm, the final one included, has ε."""
    spec, args = titan_args(model, "--gamma.init_rate_overrides.output", "0.5",
                            *(["--model.flavor", flavor] if flavor else []))
    report = inspect_model(spec, args, 64, probe_len=64)
    groups = {row["group"] for row in report["params"]}
    tied = getattr(args, "enable_weight_tying", False)  # qwen3's debug flavor: the head is the embedding
    moe = ["router"] if any(".moe.router." in row["name"] for row in report["params"]) else []
    assert bool(moe) == (args.expert_parallel_divisor() > 1)
    assert groups == {"embedding", "attention", "gate", "ffn", "norm", *moe, *([] if tied else ["output"])}
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
    # every one of TorchTitan's (qwen3's q/k norms, MLA's kv_norm, deepseek's eps-less final norm)
    theirs = [m for m in titan_own_model(model, args).modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == len(theirs) >= 2 * args.n_layers + 1 and all(m.eps == 1e-12 for m in norms)


@pytest.mark.parametrize("model", sorted(TITAN_CONFIGS))
def test_unset_knobs_keep_torchtitans_choices(model):
    """Each knob alone: ε only changes the norms, the gate only adds gate_proj, and
    without init_rate the init is TorchTitan's (inspect shows no γ)."""
    spec, args = titan_args(model, "--gamma.init_rate", "None", "--gamma.attention_gate", "none",  # TorchTitan's
                            "--gamma.norm_eps", "None")
    flavor_eps = {"llama3": 1e-5, "qwen3": 1e-6, "deepseek_v3": 1e-5}[model]  # TorchTitan's flavors'
    assert args.init is None and args.attention_gate == "none" and args.norm_eps == flavor_eps
    with torch.device("meta"):
        plain = spec.model_cls(args)
    theirs = titan_own_model(model, args)
    assert {n: p.shape for n, p in plain.named_parameters()} == {n: p.shape for n, p in theirs.named_parameters()}
    # TorchTitan's ε, deepseek's final norm without one (None: the dtype's machine epsilon)
    eps = {m.eps for m in plain.modules() if isinstance(m, torch.nn.RMSNorm)}
    assert eps == {m.eps for m in theirs.modules() if isinstance(m, torch.nn.RMSNorm)}
    assert eps == ({flavor_eps, None} if model == "deepseek_v3" else {flavor_eps})
    report = inspect_model(spec, args, 64, probe_len=64, measure=False)
    assert report["init_rate"] is None and all(r["gamma"] is None for r in report["params"])
    _, gated = titan_args(model, "--gamma.init_rate", "None", "--gamma.norm_eps", "None",
                          "--gamma.attention_gate", "headwise")
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in spec.model_cls(gated).named_parameters()}
    assert shapes["layers.0.attention.gate_proj.weight"] == (gated.n_heads, gated.dim)
    assert len(shapes) == len(dict(plain.named_parameters())) + gated.n_layers


def rotate_llama3(t: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Llama's RoPE: channel pairs (2i, 2i+1) as complex numbers times e^{iθ} (freqs_cis)."""
    seq = t.shape[1]
    pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rope[:seq].view(1, seq, 1, -1)).flatten(3)


def rotate_qwen3(t: torch.Tensor, rope: torch.Tensor, base: float) -> torch.Tensor:
    """Qwen's RoPE written out: channels i and i + hd/2 rotate by θ = pos / base^(2i/hd)
    (the cache is only checked to hold cos θ, sin θ)."""
    seq, hd = t.shape[1], t.shape[-1]
    theta = torch.arange(seq).float()[:, None] / base ** (torch.arange(0, hd, 2).float() / hd)
    cos, sin = theta.cos()[None, :, None], theta.sin()[None, :, None]
    torch.testing.assert_close(rope[:seq, : hd // 2], theta.cos())
    a, b = t[..., : hd // 2], t[..., hd // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rms_norm(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return t / torch.sqrt(t.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def naive_gated_attention(attn, x: torch.Tensor, rope: torch.Tensor, gate: str, rotate) -> torch.Tensor:
    """Causal multi-head attention written out: q/k per-head RMSNorms where the model has
    them (qwen3), RoPE by `rotate`, grouped KV heads repeated, softmax(q·k/√d) with a
    lower-triangular mask, then each head's output times sigmoid(x W_g) (one per head or
    per channel), then W_o."""
    bs, seq, _ = x.shape
    hd = attn.head_dim
    q = (x @ attn.wq.weight.T).view(bs, seq, -1, hd)
    k = (x @ attn.wk.weight.T).view(bs, seq, -1, hd)
    v = (x @ attn.wv.weight.T).view(bs, seq, -1, hd)
    if getattr(attn, "q_norm", None) is not None:
        q, k = rms_norm(q, attn.q_norm.weight, attn.q_norm.eps), rms_norm(k, attn.k_norm.weight, attn.k_norm.eps)
    q, k = rotate(q, rope), rotate(k, rope)
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", scores.softmax(dim=-1), v)
    width = hd if gate == "elementwise" else 1
    out = out * torch.sigmoid(x @ attn.gate_proj.weight.T).view(bs, seq, -1, width)
    return out.reshape(bs, seq, -1) @ attn.wo.weight.T


def naive_gated_mla(attn, x: torch.Tensor, freqs_cis: torch.Tensor, gate: str) -> torch.Tensor:
    """Multi-head latent attention written out: queries x W_q split into a plain and a
    rotary part; keys and values from the latent kv_norm(x W_kva[:r]) W_kvb, plus one
    rotary key x W_kva[r:] shared by every head; causal softmax(q·k/√d_qk); each head's
    value-wide output times sigmoid(x W_g); then W_o."""
    bs, seq, _ = x.shape
    nope, rope, vd, r = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    q = (x @ attn.wq.weight.T).view(bs, seq, -1, nope + rope)
    q = torch.cat([q[..., :nope], rotate_llama3(q[..., nope:], freqs_cis)], dim=-1)
    kv_a = x @ attn.wkv_a.weight.T
    k_rope = rotate_llama3(kv_a[..., r:].unsqueeze(2), freqs_cis)
    kv = (rms_norm(kv_a[..., :r], attn.kv_norm.weight, attn.kv_norm.eps) @ attn.wkv_b.weight.T).view(bs, seq, -1,
                                                                                                   nope + vd)
    heads = kv.shape[2]
    k = torch.cat([kv[..., :nope], k_rope.expand(-1, -1, heads, -1)], dim=-1)
    v = kv[..., nope:]
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(nope + rope)
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", scores.softmax(dim=-1), v)
    width = vd if gate == "elementwise" else 1
    out = out * torch.sigmoid(x @ attn.gate_proj.weight.T).view(bs, seq, -1, width)
    return out.reshape(bs, seq, -1) @ attn.wo.weight.T


@pytest.mark.parametrize("model", sorted(TITAN_CONFIGS))
@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_the_gate_equals_a_naive_reference_on_one_block(model, gate):
    """One block's attention of each debug model (llama3: 16 heads of 16; qwen3: 16 query
    heads of 128 over 8 KV heads, q/k norms; deepseek_v3: MLA, 16 heads, q/k 128 + 64
    rotary, values 128) with random weights: the gated forward against the references
    above, and each head scaled exactly by its gate (a gate forced shut zeroes its head)."""
    spec, args = titan_args(model, "--gamma.attention_gate", gate)
    torch.manual_seed(0)
    net = spec.model_cls(args)
    attn = net.layers["0"].attention
    for p in attn.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.08)  # norm scales near 1
    x = torch.randn(2, 24, args.dim)
    net.init_rope("cpu")
    rope = getattr(net, net.ROPE)
    got = attn(x, rope, None)
    if model == "deepseek_v3":
        reference = naive_gated_mla(attn, x, rope, gate)
    else:
        rotate = rotate_llama3 if model == "llama3" else (lambda t, r: rotate_qwen3(t, r, args.rope_theta))
        reference = naive_gated_attention(attn, x, rope, gate, rotate)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    hd = args.head_dim  # a head's output width (MLA: v_head_dim)
    with torch.no_grad():  # close head 3's gate: its channels stop reaching wo
        width = hd if gate == "elementwise" else 1
        attn.gate_proj.weight[3 * width:(3 + 1) * width] = 0
        attn.gate_proj.weight[3 * width:(3 + 1) * width, 0] = -1e4
        x[..., 0] = 1.0
        shut = attn(x, rope, None)
        attn.wo.weight[:, 3 * hd:4 * hd] = 0
        torch.testing.assert_close(shut, attn(x, rope, None), rtol=0, atol=1e-6)


def test_context_parallel_on_a_cpu_is_refused_in_one_line(builtin_assets):
    """llama3: PyTorch has no CPU ring attention (tools/gpu_check.sh runs CP on GPUs), and
    the diagnostics need every layer on one rank, which pipeline stages do not give."""
    from gamma_titan.errors import ConfigError
    from gamma_titan.training.preflight import preflight

    config = load_job_config(["--job.config_file", str(TITAN_CONFIGS["llama3"]),
                              "--parallelism.context_parallel_degree", "2"])
    with pytest.raises(ConfigError) as err:
        preflight(config, world_size=2)
    assert str(err.value) == ("parallelism.context_parallel_degree = 2: context parallelism needs CUDA SDPA "
                              "kernels (PyTorch has no CPU ring attention); use --parallelism.data_parallel_shard_degree 2 "
                              "--parallelism.context_parallel_degree 1 (shard 2)")
    config = load_job_config(["--job.config_file", str(TITAN_CONFIGS["llama3"]),
                              "--parallelism.pipeline_parallel_degree", "2"])
    with pytest.raises(ConfigError, match="gamma.diagnostics.enable = true needs parallelism.pipeline_parallel"):
        preflight(config, world_size=2)


def test_what_cannot_run_on_a_cpu_is_refused_in_one_line(builtin_assets):
    """qwen3: its TP plan hands SDPA sharded DTensors (no CPU kernel rule), and TorchTitan
    gives it no pipelining function; qwen3 MoE and deepseek_v3: TorchTitan's expert
    parallelism permutes tokens with a Triton kernel. Each refused before any process group
    starts (measured otherwise: deepseek_v3 EP 2 failed at its first forward)."""
    from gamma_titan.errors import ConfigError
    from gamma_titan.training.preflight import preflight

    def refusal(*overrides: str, model: str = "qwen3") -> str:
        config = load_job_config(["--job.config_file", str(TITAN_CONFIGS[model]), *overrides])
        with pytest.raises(ConfigError) as err:
            preflight(config, world_size=2)
        return str(err.value)

    for model, flavor in (("qwen3", ("--model.flavor", "debugmodel_moe")), ("deepseek_v3", ())):
        assert refusal("--parallelism.expert_parallel_degree", "2", *flavor, model=model) == (
            f"parallelism.expert_parallel_degree = 2: {model}'s expert parallelism (TorchTitan's) orders tokens "
            "with a Triton kernel, which needs CUDA; use --parallelism.expert_parallel_degree 1 (shard 2)")

    # the layout it names trains: DDP, as the debug flavor's tied head refuses FSDP (qwen3.py)
    assert refusal("--parallelism.tensor_parallel_degree", "2") == (
        "parallelism.tensor_parallel_degree = 2: qwen3's tensor parallelism shards SDPA's inputs, which needs "
        "CUDA SDPA kernels; use --parallelism.data_parallel_replicate_degree 2 --parallelism.tensor_parallel_degree 1 "
        "(replicate 2)")
    assert refusal("--parallelism.pipeline_parallel_degree", "2", "--gamma.diagnostics.enable", "false") == (
        "parallelism.pipeline_parallel_degree = 2: qwen3 supports 1 (no pipeline parallelism); use "
        "--parallelism.data_parallel_replicate_degree 2 --parallelism.pipeline_parallel_degree 1 (replicate 2)")


def materialised(spec, args):
    """The model of `args` with TorchTitan's init (and γ-init where set) on the CPU, its norm
    scales drawn at random near 1, so that a misplaced norm shows."""
    with torch.device("meta"):
        net = spec.model_cls(args)
    net.to_empty(device="cpu")
    with torch.no_grad():
        net.init_weights(buffer_device=torch.device("cpu"))
        for name, p in net.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return net


def through_transformers(model: str, args, net, folder):
    """`net` written by its family's adapter as a Hugging Face folder and loaded by
    transformers: (the adapter, its HF state dict, the HF model, our logits, transformers'
    logits on one random batch)."""
    import transformers
    from safetensors.torch import save_file
    from gamma_titan.convert.hf_folder import write_hf_files
    from gamma_titan.models import TRAIN_SPECS

    adapter = TRAIN_SPECS[model].state_dict_adapter(args, None)
    hf_state = adapter.to_hf(net.state_dict())
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(folder / "model.safetensors"))
    write_hf_files(folder, model, adapter, None, torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True)
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return adapter, hf_state, hf, net(tokens), hf(tokens).logits


def small_qwen3_moe(gate: str, qk_norm: bool = True, **moe):
    """qwen3's debugmodel_moe (its routing: softmax top-k, normed, scores after the experts)
    at a size a test can run in a second: 2 layers, width 64, 8 experts, 2 per token."""
    import dataclasses

    spec, args = titan_args("qwen3", "--model.flavor", "debugmodel_moe", "--gamma.attention_gate", gate)
    args = dataclasses.replace(args, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=256,
                               moe_inter_dim=48, max_seq_len=64, qk_norm=qk_norm,
                               moe_args=dataclasses.replace(args.moe_args, num_experts=8, top_k=2, **moe))
    return args, materialised(spec, args)


@pytest.mark.parametrize("gate, shared, qk_norm, hf_class", [("none", 0, True, "Qwen3MoeForCausalLM"),
                                                              ("elementwise", 0, True, "GammaForCausalLM"),
                                                              ("none", 1, True, "GammaForCausalLM"),
                                                              ("none", 0, False, "GammaForCausalLM")])
def test_qwen3_moe_runs_on_a_cpu_as_transformers_computes_it(gate, shared, qk_norm, hf_class, tmp_path):
    """TorchTitan's MoE cannot count its routed tokens on a CPU (torch.histc of int64);
    ours counts them by scatter-add and runs the experts' fp32 loop. Against transformers'
    own Qwen3Moe (ungated) and GammaForCausalLM (gated, or what Qwen3Moe cannot hold: a
    shared expert, no q/k norms): logits to 1e-4. The load counters see every routed
    (token, slot) pair."""
    pytest.importorskip("transformers")
    from gamma_titan.models.common.moe import moe_load_metrics

    args, net = small_qwen3_moe(gate, qk_norm, num_shared_experts=shared)
    adapter, _, hf, ours, theirs = through_transformers("qwen3", args, net, tmp_path)
    assert (adapter.package_reason is None) == (hf_class == "Qwen3MoeForCausalLM")
    assert type(hf).__name__ == hf_class
    assert ours.abs().max() > 1e-3 and (ours - theirs).abs().max().item() <= 1e-4
    counts = [int(r.load.sum()) for r in net.modules() if hasattr(r, "load")]
    assert counts == [2 * 48 * args.moe_args.top_k] * args.n_layers  # every (token, slot) of the batch
    load = moe_load_metrics([net])
    assert sorted(k for k in load if "layer_" in k) == sorted(f"moe/load_{w}_over_mean/layer_{i}" for i in (0, 1)
                                                              for w in ("max", "min"))
    assert all(1 <= load[f"moe/load_max_over_mean/layer_{i}"] <= 8 for i in (0, 1))
    assert all(int(r.load.sum()) == 0 for r in net.modules() if hasattr(r, "load"))  # read and reset
    if adapter.package_reason is None:  # Qwen3Moe has no expert bias: one that is not zero is refused
        from gamma_titan.errors import ConfigError

        state = net.state_dict()
        state["layers.1.moe.expert_bias"][3] = 0.5
        with pytest.raises(ConfigError, match=r"^layers.1.moe.expert_bias: not zero, and transformers' Qwen3Moe"):
            adapter.to_hf(state)


def small_deepseek_v3(gate: str, norm_eps: str, shape: dict, moe: dict):
    """deepseek_v3's debug flavor (MLA, 1 dense layer then MoE: softmax routing, expert bias,
    scores after the experts) at a size a test runs in a second, with `shape` and `moe`
    changed; norm scales and expert biases random, so a misplaced one shows."""
    import dataclasses

    spec, args = titan_args("deepseek_v3", "--gamma.attention_gate", gate, "--gamma.norm_eps", norm_eps)
    args = dataclasses.replace(args, **{**dict(dim=64, n_layers=3, n_heads=4, vocab_size=256, inter_dim=96,
                                               moe_inter_dim=32, kv_lora_rank=32, qk_nope_head_dim=16,
                                               qk_rope_head_dim=8, v_head_dim=16, max_seq_len=64), **shape},
                               moe_args=dataclasses.replace(args.moe_args, num_experts=8, top_k=2, **moe))
    net = materialised(spec, args)
    with torch.no_grad():  # as deepseek_v3's optimizers leave it: routing shifted per expert
        for name, bias in net.named_buffers():
            if name.endswith("moe.expert_bias"):
                bias.copy_(0.3 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(len(name))))
    return args, net


#: YaRN on (trained beyond original_seq_len: rotary frequencies stretched, softmax sharpened),
#: queries through their own latent (q_lora_rank), node-limited routing (2 of 4 groups)
_LONG = dict(q_lora_rank=24, original_seq_len=32, rope_factor=4.0, mscale=0.7)
_GROUPS = dict(num_expert_groups=4, num_limited_groups=2)
DEEPSEEK_HF_CASES = {
    # (gate, gamma.norm_eps, shape, moe, the class it goes to, why not transformers' DeepseekV3)
    "debug routing": ("none", "1e-12", {}, {}, "GammaForCausalLM",
                      "transformers' DeepseekV3 routes by sigmoid, this flavor by softmax"),
    "gated, long": ("elementwise", "1e-12", _LONG, _GROUPS, "GammaForCausalLM",
                    "the attention gate (no transformers class has it)"),
    "TorchTitan's ε": ("headwise", "None", {}, {}, "GammaForCausalLM",
                       "the attention gate (no transformers class has it)"),
    "V3 routing, ε 1e-6": ("none", "1e-6", _LONG, dict(score_func="sigmoid", route_norm=True, route_scale=2.5,
                                                         **_GROUPS), "DeepseekV3ForCausalLM", None),
}


@pytest.mark.parametrize("case", sorted(DEEPSEEK_HF_CASES))
def test_deepseek_v3_converts_to_hf_with_the_same_logits(case, tmp_path):
    """deepseek_v3 to Hugging Face: transformers' DeepseekV3ForCausalLM (TorchTitan's
    mapping) where it computes this very model (sigmoid routing, every ε 1e-6, no gate);
    otherwise GammaForCausalLM (the gate, softmax routing, any ε, DeepSeek's interleaved RoPE
    and YaRN), saying why. Logits to 1e-4; the HF weights read back bitwise."""
    pytest.importorskip("transformers")
    gate, eps, shape, moe, hf_class, reason = DEEPSEEK_HF_CASES[case]
    args, net = small_deepseek_v3(gate, eps, shape, moe)
    assert (args.max_seq_len > args.original_seq_len) == ("rope_factor" in shape)  # YaRN on where meant
    adapter, hf_state, hf, ours, theirs = through_transformers("deepseek_v3", args, net, tmp_path)
    assert adapter.package_reason == reason and type(hf).__name__ == hf_class
    assert ours.abs().max() > 1e-1 and (ours - theirs).abs().max().item() <= 1e-4
    ours_state, back = net.state_dict(), adapter.from_hf(hf_state)
    assert back.keys() == ours_state.keys() and all(torch.equal(back[k], ours_state[k]) for k in back)


def test_why_deepseek_v3_is_not_transformers_own(builtin_assets):
    """Each way transformers' DeepseekV3 computes otherwise, named in one line: softmax
    routing, scores before the experts, the MLA norms' fixed ε, the final norm's machine ε."""
    import dataclasses

    from gamma_titan.models.titan.deepseek_v3 import transformers_mismatch

    _, args = titan_args("deepseek_v3", "--gamma.attention_gate", "none", "--gamma.norm_eps", "1e-6")
    sigmoid = dataclasses.replace(args, moe_args=dataclasses.replace(args.moe_args, score_func="sigmoid"))
    assert transformers_mismatch(sigmoid) is None
    assert transformers_mismatch(args) == "transformers' DeepseekV3 routes by sigmoid, this flavor by softmax"
    before = dataclasses.replace(sigmoid, moe_args=dataclasses.replace(sigmoid.moe_args, score_before_experts=True))
    assert "scales each expert's output by its score" in transformers_mismatch(before)
    assert transformers_mismatch(dataclasses.replace(sigmoid, norm_eps=1e-5, every_norm_eps=1e-5)) == (
        "transformers' DeepseekV3 fixes the MLA norms' ε at 1e-06 and its final norm's at rms_norm_eps; this "
        "model's are 1e-05 and 1e-05 (gamma.norm_eps = 1e-6 matches it)")
    assert "are 1e-06 and the dtype's machine epsilon" in transformers_mismatch(
        dataclasses.replace(sigmoid, every_norm_eps=None))


@pytest.mark.parametrize("case", ["gated, long", "V3 routing, ε 1e-6"])
def test_deepseek_v3_checkpoints_save_and_load_in_hf(case, tmp_path, builtin_assets):
    """TorchTitan's own HF path with either form: `checkpoint.last_save_in_hf` writes a
    folder transformers loads with the model's logits, and `checkpoint.initial_load_in_hf`
    starts a run from it with the same weights, bitwise."""
    transformers = pytest.importorskip("transformers")
    from helpers import hf_checkpointer

    gate, eps, shape, moe, hf_class, _ = DEEPSEEK_HF_CASES[case]
    args, net = small_deepseek_v3(gate, eps, shape, moe)
    saver = hf_checkpointer(tmp_path, "checkpoint", net, "deepseek_v3", args, builtin_assets[1],
                            last_save_model_only=True, last_save_in_hf=True)
    saver.save(2, last_step=True)
    step = tmp_path / "checkpoint" / "step-2"
    hf = transformers.AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32, trust_remote_code=True)
    assert type(hf).__name__ == hf_class
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (net(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4
    _, fresh = small_deepseek_v3(gate, eps, shape, moe)
    with torch.no_grad():
        for t in fresh.parameters():
            t.mul_(0.5)  # different weights before the load
    loader = hf_checkpointer(tmp_path, "new-run", fresh, "deepseek_v3", args, builtin_assets[1],
                             initial_load_path=str(step), initial_load_in_hf=True)
    assert loader.load()
    ours, loaded = net.state_dict(), fresh.state_dict()
    assert ours.keys() == loaded.keys() and all(torch.equal(ours[k], loaded[k]) for k in ours)
