"""The paper's instruments against naive references: sink score (explicit softmax), stable
rank (torch.linalg.svdvals), residual flow and ε-domination (a hand-written forward),
gate statistics, row cosines; and that measuring leaves the model as it found it."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import small_args

from gamma_titan.diagnostics import (ActivationProbe, LiveDiagnostics, StableRanks, first_token_mass,
                                     leading_rows, row_cosine, spectral_norm)
from gamma_titan.diagnostics.live import cosine_image, weight_matrices
from gamma_titan.diagnostics.probe import EPS_DOMINANCE
from gamma_titan.diagnostics.spectral import COLD_ITERS, WARM_ITERS


def naive_attention(q, k, scale):
    """Full causal softmax: (batch, heads, T, T), GQA keys repeated per head group."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    t = q.shape[2]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(dim=-1)


def dense_model(gamma=1.0, gate="elementwise", eps=1e-12, **shape):
    from gamma_titan.models.dense import GammaDense

    torch.manual_seed(0)
    model = GammaDense(small_args(gamma, gate, eps, **shape))
    model.init_weights()
    return model


def moe_model(attention="mha", gate="elementwise"):
    from gamma_titan.models.moe import GammaMoE, moe_flavors

    args = moe_flavors["debug_mla" if attention == "mla" else "debug"]
    args.attention_gate = gate
    args.check()
    model = GammaMoE(args)
    model.init_weights()
    return model


# --- sink score ------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads, chunk", [(4, 256), (2, 7), (1, 1)])
def test_first_token_mass_matches_softmax(kv_heads, chunk):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 50, 16, generator=gen) * 2
    k = torch.randn(2, kv_heads, 50, 16, generator=gen) * 2
    k[:, :, 0] += 3  # a real sink: much of the mass on key 0
    attn = naive_attention(q, k, 1 / math.sqrt(16))
    expected = attn[:, :, 1:, 0].mean(dim=-1)
    got = first_token_mass(q, k, chunk=chunk)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert got.mean() > 0.1  # not a trivially uniform case


@pytest.mark.parametrize("chunk", [256, 7])
def test_first_token_mass_under_the_block_causal_mask_is_each_documents_own(chunk):
    """Under TorchTitan's block-causal mask (documents split after each EOS), the score is
    the causal score of each document on its own: mass on the document's first token,
    over its queries after the first, averaged over every such query of the sequence."""
    from torch.nn.attention.flex_attention import and_masks
    from torchtitan.models.attention import get_causal_mask_mod, get_document_mask_mod

    eos = 5
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 40, 16, generator=gen) * 2, torch.randn(2, 2, 40, 16, generator=gen) * 2
    tokens = torch.randint(6, 100, (2, 40), generator=gen)
    tokens[0, [9, 25]] = eos  # documents 0..9, 10..25, 26..39
    tokens[1, 0] = eos  # a one-token document: its only query sees itself
    mask_mod = and_masks(get_causal_mask_mod(), get_document_mask_mod(tokens, eos))
    got = first_token_mass(q, k, chunk=chunk, mask_mod=mask_mod)
    for b, docs in enumerate([[(0, 10), (10, 26), (26, 40)], [(0, 1), (1, 40)]]):
        masses = torch.cat([naive_attention(q[b:b + 1, :, i:j], k[b:b + 1, :, i:j], 1 / math.sqrt(16))[0, :, 1:, 0]
                            for i, j in docs], dim=-1)  # (heads, queries after each document's first)
        torch.testing.assert_close(got[b], masses.mean(dim=-1), atol=1e-5, rtol=0)
    causal = first_token_mass(q, k, chunk=chunk)
    assert (got[0] - causal[0]).abs().min() > 1e-3  # the documents are seen: not the causal score
    torch.testing.assert_close(first_token_mass(q, k, chunk=chunk, mask_mod=get_causal_mask_mod()), causal)


@pytest.mark.parametrize("attention", ["dense-gqa", "mla"])
def test_probe_sink_score_is_the_layers_own_attention(attention):
    """The probe's per-layer score equals the naive attention matrix's first column,
    built from the layer's q, k; and that matrix reproduces the layer's SDPA output
    (so q, k and the softmax scale are the ones the model uses)."""
    model = dense_model(n_kv_heads=2) if attention == "dense-gqa" else moe_model("mla")
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    captured = {}
    handle = model.layers["1"].attention.register_forward_hook(
        lambda m, inp, out: captured.update(x=inp[0], rope=inp[1], out=out))
    with torch.no_grad(), ActivationProbe(model) as probe:
        model(tokens)
    handle.remove()
    attn_module = model.layers["1"].attention
    with torch.no_grad():
        q, k, v = (t.transpose(1, 2) for t in attn_module.qkv(captured["x"], captured["rope"]))
        attn = naive_attention(q, k, 1 / math.sqrt(q.shape[-1]))
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        heads = (attn @ v).transpose(1, 2)
        if attn_module.gate != "none":
            heads = heads * attn_module.gate_values(captured["x"])
        out = attn_module.wo(heads.reshape(*heads.shape[:2], -1))
    torch.testing.assert_close(out, captured["out"], atol=1e-5, rtol=1e-4)
    metrics = probe.metrics()
    assert metrics["sink_score/layer_1"] == pytest.approx(attn[:, :, 1:, 0].mean().item(), abs=1e-5)
    n = model.model_args.n_layers
    assert metrics["sink_score/mean"] == pytest.approx(sum(metrics[f"sink_score/layer_{i}"] for i in range(n)) / n)


# --- residual flow, ε-domination, gates ---------------------------------------------------


@pytest.mark.parametrize("eps", [1e-12, 1e-2])
def test_probe_residual_flow_eps_and_gates_match_a_hand_forward(eps):
    model = dense_model(gamma=1.0, eps=eps)
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), ActivationProbe(model) as probe:
        model(tokens)
    metrics = probe.metrics()

    with torch.no_grad():  # the decoder by hand
        e = h = model.tok_embeddings(tokens)
        rope = model.rope[: tokens.shape[1]]
        for i, block in model.layers.items():
            x = h
            dominated = [(eps > EPS_DOMINANCE * x.pow(2).mean(-1)).float().mean().item()]
            attn_in = block.attention_norm(x)
            gate = block.attention.gate_values(attn_in)
            h = x + block.attention(attn_in, rope)
            dominated.append((eps > EPS_DOMINANCE * h.pow(2).mean(-1)).float().mean().item())
            h = h + block.feed_forward(block.ffn_norm(h))
            assert metrics[f"eps_dominated_fraction/layer_{i}/attention_norm"] == pytest.approx(dominated[0])
            assert metrics[f"eps_dominated_fraction/layer_{i}/ffn_norm"] == pytest.approx(dominated[1])
            assert metrics[f"eps_dominated_fraction/layer_{i}"] == pytest.approx(sum(dominated) / 2)
            assert metrics[f"gate_mean/layer_{i}"] == pytest.approx(gate.mean().item(), rel=1e-5)
            assert metrics[f"gate_sparsity/layer_{i}"] == pytest.approx((gate < 0.1).float().mean().item())
    expected = ((h - e).norm() / e.norm()).item()
    assert metrics["residual_flow_ratio"] == pytest.approx(expected, rel=1e-5)
    # γ = 1, d = 256: σ²(e) ≈ 1/256, far below 10·1e-2 and far above 10·1e-12
    assert metrics["eps_dominated_fraction/layer_0/attention_norm"] == (1.0 if eps == 1e-2 else 0.0)


def test_a_layers_eps_fraction_counts_each_norm_application_once():
    """MLA runs two norms inside its attention (q_norm, kv_norm), which run again when the
    probe asks the attention for its queries and keys: a layer's ε-dominated fraction is
    over the positions of one forward's norm applications, as a plain hook on every RMSNorm
    counts them."""
    model = moe_model("mla")
    norms = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.RMSNorm)]
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    seen: dict[str, list] = {}

    def record(name):
        return lambda module, inputs: seen.setdefault(name, []).append(inputs[0].detach().float().pow(2).mean(-1))

    handles = [m.register_forward_pre_hook(record(name)) for name, m in norms]
    with torch.no_grad():
        model(tokens)
    for h in handles:
        h.remove()
    assert all(len(v) == 1 for v in seen.values())  # one application each in a forward
    # ε between the sites' scales, so that the sites' fractions differ (a double count would show)
    eps = EPS_DOMINANCE * torch.cat([v[0].flatten() for v in seen.values()]).median().item()
    for _, m in norms:
        m.eps = eps
    with torch.no_grad(), ActivationProbe(model) as probe:
        model(tokens)
    metrics = probe.metrics()
    for i in range(model.model_args.n_layers):
        sites = {name: v[0] for name, v in seen.items() if name.startswith(f"layers.{i}.")}
        assert {n.split(".", 2)[2] for n in sites} >= {"attention.q_norm", "attention.kv_norm", "attention_norm"}
        fractions = {n: (eps > EPS_DOMINANCE * ms).float().mean().item() for n, ms in sites.items()}
        assert len(set(fractions.values())) > 1, fractions
        for n, f in fractions.items():
            assert metrics[f"eps_dominated_fraction/layer_{i}/{n.split('.', 2)[2]}"] == pytest.approx(f)
        dominated = sum((eps > EPS_DOMINANCE * ms).sum().item() for ms in sites.values())
        positions = sum(ms.numel() for ms in sites.values())
        assert metrics[f"eps_dominated_fraction/layer_{i}"] == pytest.approx(dominated / positions)


def test_no_gate_statistics_without_a_gate():
    model = dense_model(gate="none")
    with torch.no_grad(), ActivationProbe(model) as probe:
        model(torch.zeros(1, 8, dtype=torch.long))
    assert not any(k.startswith("gate_") for k in probe.metrics())


# --- stable rank and cosines -----------------------------------------------------------


def test_spectral_norm_and_stable_rank_match_svd():
    gen = torch.Generator().manual_seed(3)
    cases = {
        "gaussian": torch.randn(384, 256, generator=gen),  # the hard case: σ1 ≈ σ2
        "decaying": torch.randn(200, 300, generator=gen) @ torch.diag(torch.logspace(0, -2, 300)),
        "condensed": torch.randn(256, 1, generator=gen) @ torch.randn(1, 128, generator=gen)
                     + 0.05 * torch.randn(256, 128, generator=gen),
    }
    ranks = StableRanks()
    for name, w in cases.items():
        s = torch.linalg.svdvals(w)
        assert spectral_norm(w).sigma.item() == pytest.approx(s[0].item(), rel=1e-4), name
        expected = (s.pow(2).sum() / s[0] ** 2).item()
        assert ranks(name, w).item() == pytest.approx(expected, rel=1e-4), name
    # a stack of experts: one stable rank each, in one batched iteration
    stack = torch.randn(4, 64, 32, generator=gen) * torch.arange(1, 5).view(4, 1, 1)
    s = torch.linalg.svdvals(stack)
    torch.testing.assert_close(ranks("experts", stack), s.pow(2).sum(-1) / s[:, 0] ** 2, rtol=1e-4, atol=0)


def test_cold_start_is_accurate_on_the_slowest_case():
    """A square Gaussian matrix (a weight at initialisation, 0.1B's attention shape) has
    σ1 ≈ σ2, the slowest case for power iteration: COLD_ITERS steps still give σ within
    1e-3 (2e-4 measured), from below."""
    w = torch.randn(768, 768, generator=torch.Generator().manual_seed(5))
    exact = torch.linalg.matrix_norm(w.double(), ord=2).item()
    result = spectral_norm(w)
    assert result.iterations == COLD_ITERS
    assert 0 <= 1 - result.sigma.item() / exact < 1e-3


def test_batched_weights_give_what_each_gives_alone():
    """Same-shape weights iterate as one stack (as on a GPU; the CPU's default is one at
    a time); bf16 weights are converted (within the memory budget, the largest a block of
    rows at a time): the stable ranks are those of each weight alone, of its fp32 values."""
    steps = (50, 10)  # the same on both sides: they agree at any count
    weights = weight_matrices(dense_model())
    together = StableRanks(*steps, stack=True).all(weights)
    for name, w in weights.items():
        torch.testing.assert_close(together[name], StableRanks(*steps)(name, w), rtol=1e-5, atol=0)
    bf16 = {name: w.detach().bfloat16() for name, w in weights.items()}
    expected = StableRanks(*steps).all({name: w.float() for name, w in bf16.items()})
    for stack in (True, False):
        got = StableRanks(*steps, stack=stack).all(bf16)
        for name in weights:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=0)


def test_warm_start_converges_in_fewer_iterations():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(256, 128, generator=gen) @ torch.diag(torch.logspace(0, -1, 128))
    ranks = StableRanks()
    ranks("w", w)
    cold = ranks.iterations["w"]
    w2 = w + 1e-3 * torch.randn(256, 128, generator=gen)  # one optimizer step later
    s = torch.linalg.svdvals(w2)
    assert ranks("w", w2).item() == pytest.approx((s.pow(2).sum() / s[0] ** 2).item(), rel=1e-2)
    assert ranks.iterations["w"] < cold / 3, (ranks.iterations["w"], cold)


def test_warm_start_is_a_fixed_few_steps():
    ranks = StableRanks()
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(6))
    ranks("w", w)
    assert ranks.iterations["w"] == COLD_ITERS
    ranks("w", w * 1.01)
    assert ranks.iterations["w"] == WARM_ITERS < COLD_ITERS / 10


def test_row_cosine_and_its_image():
    w = torch.randn(10, 6)
    c = row_cosine(leading_rows(w, 5))
    naive = torch.tensor([[torch.nn.functional.cosine_similarity(w[i], w[j], dim=0).item() for j in range(5)]
                          for i in range(5)])
    torch.testing.assert_close(c, naive, atol=1e-6, rtol=0)
    image = cosine_image(c)
    assert image.shape == (5, 5, 3) and image.dtype == torch.uint8


# --- measuring leaves training alone ---------------------------------------------------


def test_measure_restores_buffers_mode_and_rng_and_covers_expert_stacks():
    from gamma_titan.config import Diagnostics

    model = moe_model("mha")
    model.train()
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(5))
    model(tokens)  # some routing history in the load counters
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    live = LiveDiagnostics(Diagnostics(enable=True, cosine_rows=16), model, tokens)
    metrics, maps = live.measure(step=1, with_images=True)
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert all(p.grad is None for p in model.parameters())

    experts = model.layers["1"].moe.experts.w1.detach()
    s = torch.linalg.svdvals(experts)
    per_expert = s.pow(2).sum(-1) / s[:, 0] ** 2
    assert metrics["gamma/stable_rank/layers.1.moe.experts.w1/mean"] == pytest.approx(per_expert.mean().item(), rel=1e-2)
    assert metrics["gamma/stable_rank/layers.1.moe.experts.w1/min"] == pytest.approx(per_expert.min().item(), rel=1e-2)
    assert "gamma/stable_rank/layers.1.moe.router.gate.weight" in metrics
    assert "gamma/stable_rank/tok_embeddings.weight" in metrics and "gamma/stable_rank/output.weight" in metrics
    assert set(maps) == {f"gamma/cosine/{n}" for n in live.cosine_params} and maps
    assert all(m.shape == (16, 16) for m in maps.values())


class HostReads(TorchDispatchMode):
    """Counts the ops by which a tensor's value reaches Python (.item(), bool(), int(),
    float() go through them): on a GPU, each one waits for the device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_measurement_reads_its_numbers_back_once(monkeypatch):
    """Fixed power-iteration steps and results kept on the device: nothing in a
    measurement reads a value back on the way (the old code did ~4,500 times for the
    debug model: a convergence test per step, an .item() per number), then one transfer
    brings all its numbers. The probe forward stops at the final norm: the output head
    (vocabulary-sized logits) never runs."""
    from gamma_titan.config import Diagnostics
    from gamma_titan.diagnostics import live as live_module

    model = dense_model()
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(7))
    live = LiveDiagnostics(Diagnostics(enable=True), model, tokens)
    transfers = []
    to_host = live_module.to_host
    monkeypatch.setattr(live_module, "to_host", lambda tensors: transfers.append(len(tensors)) or to_host(tensors))
    head = model.output.register_forward_hook(lambda *args: pytest.fail("the probe ran the output head"))
    for step, iterations in ((1, COLD_ITERS), (100, WARM_ITERS)):
        transfers.clear()
        with HostReads() as reads:
            metrics, _ = live.measure(step=step, with_images=False)
        assert reads.count == 0, step
        assert len(transfers) == 1 and transfers[0] == len(metrics) - 1  # all but diagnostics_seconds
        assert set(live.stable_ranks.iterations.values()) == {iterations}
    head.remove()
    # the final norm's hook still fires: its ε-domination and the residual flow (its input)
    assert {"gamma/eps_dominated_fraction/final_norm", "gamma/residual_flow_ratio"} <= set(metrics)


def peak_extra_bytes(fn) -> int:
    """The most memory fn holds at once beyond what existed before it: the running sum of
    the CPU allocations and frees that the profiler records while it runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    total = peak = 0
    for _, nbytes in events:
        total += nbytes
        peak = max(peak, total)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_measurement_holds_less_than_the_largest_weight(dtype):
    """The peak extra memory of a whole measurement (probe forward on a small batch,
    stable ranks cold then warm, row-cosine maps), measured: at most the largest single
    weight. bf16 weights need fp32 copies: stacks within that budget, the largest weight
    a block of rows at a time (the old code held every fp32 copy at once: 12x the bound)."""
    from gamma_titan.config import Diagnostics

    model = dense_model()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(8))
    live = LiveDiagnostics(Diagnostics(enable=True, cosine_rows=16), model, tokens)
    # Stacked, as on a GPU (the most it copies); fewer steps, the same memory: a quicker profile
    live.stable_ranks = StableRanks(30, 5, stack=True)
    for step in (1, 100):
        peak = peak_extra_bytes(lambda: live.measure(step=step, with_images=True))
        assert 0 < peak <= largest, (step, peak, largest)


def test_default_cosine_params_pick_first_and_last_block():
    model = dense_model()
    dense = [n for n, w in weight_matrices(model).items() if w.ndim == 2]
    chosen = model.model_args.default_cosine_params()
    assert chosen == [
        "layers.0.attention.wo.weight", "layers.0.feed_forward.w1.weight",
        "layers.3.attention.wo.weight", "layers.3.feed_forward.w1.weight"]
    assert set(chosen) <= set(dense)
    for attention in ("mha", "mla"):
        model = moe_model(attention)
        moe = [n for n, w in weight_matrices(model).items() if w.ndim == 2]
        chosen = model.model_args.default_cosine_params()
        assert chosen == [  # layer 0 is dense, layer 3 an MoE layer with shared experts
            "layers.0.attention.wo.weight", "layers.0.feed_forward.w1.weight",
            "layers.3.attention.wo.weight", "layers.3.moe.shared_experts.w1.weight"]
        assert set(chosen) <= set(moe)


@pytest.mark.multiprocess
def test_sharded_weights_give_the_same_stable_rank_without_gathering_them():
    """4 gloo processes: FSDP-, TP- and EP-style shardings (rows, columns, experts,
    replicated, strided) of a matrix, an expert stack and a bf16 matrix, and FSDP over TP
    on a 2x2 mesh (strided shards, uneven ones included), give the unsharded stable rank
    (rtol 1e-5), cold and warm-started; no collective moves more than the vectors (no
    weight is regathered, strided shards included)."""
    import os
    import subprocess
    import sys

    from helpers import REPO

    script = REPO / "tests" / "scripts" / "sharded_spectral.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           str(script)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
