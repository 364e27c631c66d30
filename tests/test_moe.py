"""gamma_moe: γ-init of experts, router, MLA and gate; the residual-flow law; the router's
counts; and its bad-input checks."""

import numpy as np
import pytest
import torch

import gamma_titan  # noqa: F401
from gamma_titan.errors import ConfigError
from gamma_titan.inspect_model import inspect_model
from gamma_titan.models.common.moe import CountingReorderer, TokenChoiceRouter, tokens_per_expert
from gamma_titan.models.moe import GammaMoE, moe_flavors
from gamma_titan.models import TRAIN_SPECS

SPEC = TRAIN_SPECS["gamma_moe"]


def moe_args(flavor="debug", gamma=1.0, gate="elementwise", **shape):
    args = moe_flavors[flavor]
    for key, value in shape.items():
        setattr(args, key, value)
    args.init.rate, args.attention_gate, args.norm_eps = gamma, gate, 1e-12
    args.check()
    return args


# Every weight has >= 8192 entries, so 5% is > 6 standard errors of the std.
BIG = dict(dim=512, n_heads=8, n_routed_experts=16, moe_hidden_dim=256, ffn_hidden_dim=1024,
           vocab_size=1024, n_layers=2)
BIG_MLA = dict(q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)


def expected_fan_in(name: str, a) -> int:
    last = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    if ".moe.experts." in name:
        return a.moe_hidden_dim if last == "w2" else a.dim
    if ".moe.shared_experts." in name:
        return a.moe_hidden_dim * a.n_shared_experts if last == "w2" else a.dim
    if ".feed_forward." in name:
        return a.ffn_hidden_dim if last == "w2" else a.dim
    return {"wq_b": a.q_lora_rank, "wkv_b": a.kv_lora_rank,
            "wo": a.n_heads * (a.v_head_dim if a.attention == "mla" else a.head_dim)}.get(last, a.dim)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("flavor, extra", [("debug", {}), ("debug_mla", BIG_MLA)], ids=["mha", "mla"])
def test_every_matrix_has_std_d_in_to_minus_gamma(flavor, extra, gamma):
    args = moe_args(flavor, gamma, "headwise", **BIG, **extra)
    args.init.seed = 0
    report = inspect_model(SPEC, args, 64, seed=0)
    groups = set()
    for row in report["params"]:
        if row["target_std"] is None:
            assert row["mean"] == 1.0, row["name"]
            continue
        assert row["fan_in"] == expected_fan_in(row["name"], args), row["name"]
        assert abs(row["std"] / row["fan_in"] ** -gamma - 1) < 0.05, row
        groups.add(row["group"])
    assert groups == {"embedding", "attention", "gate", "ffn", "router", "output"}
    names = {r["name"] for r in report["params"]}
    assert "layers.1.moe.experts.w1" in names and "layers.1.moe.router.gate.weight" in names
    if flavor == "debug_mla":
        assert {"layers.0.attention.wkv_a.weight", "layers.0.attention.kv_norm.weight",
                "layers.0.attention.q_norm.weight"} <= names


def test_mla_gate_width_follows_v_head_dim():
    args = moe_args("debug_mla", gate="elementwise")
    model = GammaMoE(args)
    attn = model.layers["0"].attention
    assert attn.gate_proj.weight.shape == (args.n_heads * args.v_head_dim, args.dim)
    assert model.layers["0"].attention.kv_norm.eps == 1e-12
    assert all(m.eps == 1e-12 for m in model.modules() if isinstance(m, torch.nn.RMSNorm))


@pytest.mark.parametrize("gamma", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_residual_flow_law_holds_for_moe(gamma, attention):
    widths = (128, 256, 512)
    ratios = []
    for d in widths:
        shape = dict(dim=d, n_heads=d // 64, n_layers=2, vocab_size=512, ffn_hidden_dim=8 * d // 3 // 64 * 64,
                     moe_hidden_dim=d // 2, attention=attention)
        if attention == "mla":  # latent ranks and head widths scale with d, as in real flavors
            shape.update(q_lora_rank=d // 2, kv_lora_rank=d // 4, qk_nope_head_dim=32,
                         qk_rope_head_dim=32, v_head_dim=64)
        args = moe_args("debug", gamma, **shape)
        ratios.append(np.mean([inspect_model(SPEC, args, 128, seed=s)["residual_flow_ratio"] for s in (0, 1)]))
    slope = np.polyfit(np.log(widths), np.log(ratios), 1)[0]
    assert abs(slope - (1 - gamma)) <= 0.15, (ratios, slope)


def test_router_counts_and_reorder_match_a_naive_count():
    torch.manual_seed(0)
    router = TokenChoiceRouter(32, 8, top_k=2, score_func="sigmoid", route_norm=True, route_scale=1.0)
    x = torch.randn(50, 32)
    bias = torch.zeros(8)
    bias[3] = 10.0  # the bias chooses expert 3 for every token but does not weight it
    top, idx, counts = router(x, bias)
    naive = torch.tensor([(idx == e).sum().item() for e in range(8)])
    assert torch.equal(counts, naive) and counts[3] == 50 and counts.sum() == 100
    torch.testing.assert_close(top.sum(-1), torch.ones(50))  # route_norm
    assert torch.equal(router.load, counts)
    sorted_scores, order, counts2 = CountingReorderer(8, 2)(top, idx)
    assert torch.equal(counts2, counts)
    assert torch.equal(idx.reshape(-1)[order], torch.sort(idx.reshape(-1), stable=True).values)
    assert torch.equal(tokens_per_expert(torch.tensor([[0, 0], [2, 0]]), 3), torch.tensor([3, 0, 1]))


def test_active_parameters_and_flops_from_shapes():
    a = moe_flavors["1.5B-A0.25B"]
    with torch.device("meta"):
        model = GammaMoE(a)
    total = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 1)
    assert a.matmul_params(active=False) == total - norms - a.vocab_size * a.dim
    expert = 3 * a.dim * a.moe_hidden_dim
    idle = (a.n_layers - a.n_dense_layers) * (a.n_routed_experts - a.top_k) * expert
    assert a.active_params() == a.matmul_params(active=False) - idle
    assert 0.2e9 < a.active_params() - a.dim * a.vocab_size < 0.3e9  # "A0.25B" without embeddings
    assert 1.4e9 < total < 1.7e9


@pytest.mark.parametrize("shape, key", [
    (dict(top_k=9), "model_args.top_k"),
    (dict(attention="gqa"), "model_args.attention"),
    (dict(attention="mla", kv_lora_rank=256), "model_args.kv_lora_rank"),
    (dict(attention="mla", qk_rope_head_dim=31), "model_args.qk_rope_head_dim"),
    (dict(n_dense_layers=4), "model_args.n_dense_layers"),
    (dict(score_func="relu"), "model_args.score_func"),
])
def test_bad_shapes_name_their_key(shape, key):
    args = moe_flavors["debug"]
    for k, v in shape.items():
        setattr(args, k, v)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        args.check()


def test_balance_loss_is_one_when_balanced_and_larger_when_not():
    from gamma_titan.models.common.moe import balance_loss

    scores = torch.full((8, 4), 0.5)
    assert balance_loss(scores, torch.tensor([4, 4, 4, 4]), top_k=2).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.9, 0.9, 0.1, 0.1]]).repeat(8, 1)
    # f = (1/2, 1/2, 0, 0), P = (0.45, 0.45, 0.05, 0.05): 4 · (0.5·0.45 + 0.5·0.45) = 1.8
    assert balance_loss(skewed, torch.tensor([8, 8, 0, 0]), top_k=2).item() == pytest.approx(1.8)


def test_aux_loss_enters_the_router_gradient_only():
    from gamma_titan.models.common.moe import MoELayer, balance_loss
    from gamma_titan.models.moe.args import MoEModelArgs

    margs = MoEModelArgs(dim=32, n_routed_experts=4, top_k=2, moe_hidden_dim=16, n_shared_experts=1,
                         load_balance_coeff=None).moe_args()
    torch.manual_seed(0)
    plain = MoELayer(margs, 32, 16, aux_loss_coeff=0.0)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with_aux = MoELayer(margs, 32, 16, aux_loss_coeff=0.1)
    with_aux.load_state_dict(plain.state_dict())
    with_aux.aux_loss_weight = 0.5
    x = torch.randn(2, 6, 32)
    out_plain, out_aux = plain(x), with_aux(x)
    assert torch.equal(out_plain, out_aux)  # the forward output is untouched
    out_plain.sum().backward()
    out_aux.sum().backward()
    # Reference: d(0.5 · 0.1 · mean over the 2 sequences of balance_loss)/dW_router, written
    # out from the router's scores (DeepSeek-V3's sequence-wise loss).
    w = plain.router.gate.weight.detach().clone().requires_grad_()
    total = 0
    for sequence in x:
        scores = torch.sigmoid(sequence @ w.T)
        _, idx = torch.topk(scores.detach(), 2, dim=-1)
        counts = torch.stack([(idx == e).sum() for e in range(4)])
        total = total + balance_loss(scores, counts, 2) / len(x)
    (0.5 * 0.1 * total).backward()
    torch.testing.assert_close(with_aux.router.gate.weight.grad - plain.router.gate.weight.grad, w.grad)
    assert with_aux.last_aux_loss.item() == pytest.approx(0.1 * total.item(), rel=1e-6)
    for (name, a), (_, b) in zip(plain.named_parameters(), with_aux.named_parameters()):
        if "router" not in name:
            assert torch.equal(a.grad, b.grad), name


def _loss_and_grads(model, tokens, kernel):
    import copy

    model = copy.deepcopy(model)
    for module in model.modules():
        if hasattr(module, "kernel"):  # RoutedExperts
            module.kernel = kernel
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("flavor", ["debug", "debug_mla"])
def test_the_grouped_kernel_on_the_cpu_matches_the_exact_loop(flavor):
    """The CUDA path of the routed experts (tokens permuted into padded groups by
    TorchTitan's generate_permute_indices, use_cpu=True here; torch._grouped_mm in bf16,
    the CPU's fallback here) against the exact fp32 loop on the same weights and batch.
    The grouped kernel rounds the experts' input, weights and hidden activations to bf16
    (relative error <= 2^-8 each), so every gradient is held to twice bf16's epsilon
    (2^-6 of its norm; measured: 5.3e-3 at worst, an expert stack); the loss, where the
    experts' output is a small share of the residual stream at γ = 1, to 1e-4 (measured:
    equal). "auto" on a CPU is the loop, bit for bit."""
    args = moe_flavors[flavor]
    args.init.seed = 0
    model = GammaMoE(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    loss, grads = _loss_and_grads(model, tokens, "loop")
    loss_g, grads_g = _loss_and_grads(model, tokens, "grouped")
    assert loss_g == pytest.approx(loss, rel=1e-4)
    assert set(grads_g) == set(grads) and all(g is not None for g in grads_g.values())
    rel = {n: ((grads_g[n] - grads[n]).norm() / grads[n].norm()).item() for n in grads}
    assert max(rel.values()) <= 2 ** -6, max(rel.items(), key=lambda kv: kv[1])
    assert max(v for n, v in rel.items() if ".experts." in n) > 0  # the grouped kernel did run, in bf16
    loss_a, grads_a = _loss_and_grads(model, tokens, "auto")
    assert loss_a == loss and all(torch.equal(grads_a[n], grads[n]) for n in grads)


@pytest.mark.parametrize("ep_enabled", [False, True], ids=["no_ep", "ep"])
def test_compiled_experts_run_the_kernel_torchtitan_compiled(ep_enabled, monkeypatch):
    """TorchTitan's apply_compile (llama4's, which gamma_moe's parallelize runs) replaces its
    module's grouped-GEMM function with the compiled one (under EP, one that also marks the
    token count dynamic); the routed experts must call that, not the eager function bound
    when our module was imported (which they did: every compiled MoE run ran its experts'
    SiLU·mul eager)."""
    from torchtitan.config.job_config import Compile
    from torchtitan.models.llama4.infra.parallelize import apply_compile
    from torchtitan.models.moe import moe as titan_moe

    eager = titan_moe._run_experts_grouped_mm
    monkeypatch.setattr(titan_moe, "_run_experts_grouped_mm", eager)  # put back after the test
    args = moe_flavors["debug"]
    args.init.seed = 0
    model = GammaMoE(args)
    model.init_weights()
    for module in model.modules():
        if hasattr(module, "kernel"):  # RoutedExperts: the grouped kernel, as on a GPU
            module.kernel = "grouped"
    with torch._dynamo.config.patch(capture_scalar_outputs=False):  # apply_compile sets it: put back after
        apply_compile(model, Compile(enable=True, backend="eager"), ep_enabled)
    installed = titan_moe._run_experts_grouped_mm
    assert installed is not eager
    assert ("_dynamic" in installed.__qualname__) == ep_enabled
    calls = []

    def counting(*tensors):  # the installed kernel, counted
        calls.append(tensors[3].shape)
        return installed(*tensors)

    monkeypatch.setattr(titan_moe, "_run_experts_grouped_mm", counting)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        model(tokens)
    moe_layers = sum(1 for block in model.layers.values() if block.moe_enabled)
    assert moe_layers > 0 and len(calls) == moe_layers
