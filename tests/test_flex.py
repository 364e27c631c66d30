"""TorchTitan's flex-attention flavors: the readers that run a model outside a training
step (the init report of `inspect` and the start-up summary, the live diagnostics) give it
the block-causal mask the trainer builds from the batch's EOS tokens.

The references: the same weights under the flavor's SDPA twin (same shapes, causal SDPA)
where each sequence holds one document, and where an EOS splits it, the twin with each
attention kernel given the dense block-causal mask, built here from the tokens. Training a flex flavor on a CPU is refused before launch:
torch has no flex backward there."""

from dataclasses import dataclass

import pytest
import torch

from titan_cases import TITAN_CONFIGS, titan_args
from gamma_titan.config import load_job_config
from gamma_titan.inspect_model import inspect_model

SDPA_TWIN = {"llama3": "debugmodel", "deepseek_v3": "debugmodel"}
CASES = [("llama3", "none"), ("llama3", "elementwise"), ("deepseek_v3", "none"), ("deepseek_v3", "headwise")]
#: The probe batch inspect_model draws (its defaults): 2 x 128 tokens.
BATCH, LENGTH = 2, 128
#: deepseek_v3's experts taken round-robin: top-k routing is discontinuous, and flex's and
#: SDPA's last bits (1e-7 apart) flipped an expert choice in a MoE layer (8e-4 in the flow).
FIXED_ROUTES = {"llama3": (), "deepseek_v3": ("--debug.moe_force_load_balance", "true")}


@dataclass
class Eos:
    """What the mask builders read of a tokenizer."""
    eos_id: int


def report(model: str, flavor: str, gate: str, eos: Eos | None) -> dict:
    spec, args = titan_args(model, "--model.flavor", flavor, "--gamma.attention_gate", gate, *FIXED_ROUTES[model])
    return inspect_model(spec, args, LENGTH, tokenizer=eos)


def probe_batch(model: str) -> torch.Tensor:
    """The tokens inspect_model walks (its probe_tokens, drawn from the run's seed)."""
    from gamma_titan.models.common.norm_inputs import probe_seed, probe_tokens

    _, args = titan_args(model)
    return probe_tokens(args.vocab_size, LENGTH, probe_seed(args), BATCH, LENGTH)


def unused_token(tokens: torch.Tensor) -> int:
    return next(t for t in range(tokens.max() + 2) if not (tokens == t).any())


def splitting_token(tokens: torch.Tensor) -> int:
    """A token id that appears inside both sequences (an EOS there splits each in documents)."""
    for t in tokens[0, 20:100].tolist():
        if all(((row[:-1] == t).any() for row in tokens)):
            return t
    raise AssertionError("no token appears inside both probe sequences")


def built(model: str, flavor: str, gate: str):
    """The model as the trainer initialises it, on the CPU, whole."""
    spec, args = titan_args(model, "--model.flavor", flavor, "--gamma.attention_gate", gate, *FIXED_ROUTES[model])
    with torch.device("meta"):
        net = spec.model_cls(args)
    net.to_empty(device="cpu")
    with torch.no_grad():
        net.init_weights(buffer_device=torch.device("cpu"))
    return net


def document_mask(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """(batch, 1, T, T) bool: causal, and within the document (a document ends after each EOS)."""
    t = tokens.shape[1]
    doc = torch.cumsum(torch.nn.functional.pad((tokens == eos).long(), (1, 0))[:, :-1], dim=1)
    return ((doc[:, :, None] == doc[:, None, :]) & torch.ones(t, t, dtype=torch.bool).tril())[:, None]


class MaskedSDPA(torch.nn.Module):
    """SDPA with an explicit boolean mask, in place of a block's attention kernel."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v, *, scale=None, enable_gqa=False, **_):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale,
                                                                enable_gqa=enable_gqa)


@torch.no_grad()
def block_causal_reference(net, tokens: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, h_L) of the SDPA model with each block's kernel given the dense block-causal mask."""
    for block in net.layers.values():
        block.attention.inner_attention = MaskedSDPA(document_mask(tokens, eos))
    e = h = net.tok_embeddings(tokens)
    inputs = net.block_inputs(tokens, "cpu")
    for layer in net.layers.values():
        h = layer(h, *inputs)
    return e, h


@pytest.mark.parametrize("model, gate", CASES)
def test_the_init_report_of_a_flex_flavor_is_its_sdpa_twins_on_one_document(model, gate):
    """No EOS in the probe batch: the block-causal mask is the causal one, and every number
    of the init report (each weight's std, σ²(h) at every norm, residual flow, logits)
    equals the SDPA flavor's on the same weights. Before, ungated, the walk died in
    TorchTitan's attention (no BlockMask); gated, flex ran without a mask, both ways:
    residual flow 0.1469 against 0.3459 (llama3, elementwise)."""
    eos = Eos(unused_token(probe_batch(model)))
    flex, sdpa = report(model, f"{SDPA_TWIN[model]}_flex_attn", gate, eos), report(model, SDPA_TWIN[model], gate, None)
    for key in ("residual_flow_ratio", "final_hidden_var", "logits_std", "hidden_var", "embedding_var"):
        assert flex[key] == pytest.approx(sdpa[key], rel=1e-5), key
    assert [s["name"] for s in flex["norm_sites"]] == [s["name"] for s in sdpa["norm_sites"]]
    for f, s in zip(flex["norm_sites"], sdpa["norm_sites"]):
        assert f["var"] == pytest.approx(s["var"], rel=1e-5), f["name"]
    assert [r["std"] for r in flex["params"]] == [r["std"] for r in sdpa["params"]]  # the same weights


@pytest.mark.parametrize("model, gate", CASES[1::2])
def test_the_init_report_of_a_flex_flavor_keeps_each_document_to_itself(model, gate):
    """An EOS inside each probe sequence: the report's residual flow and logits are those of
    the SDPA twin run document by document, and no longer its whole-sequence ones."""
    tokens = probe_batch(model)
    eos = splitting_token(tokens)
    flex = report(model, f"{SDPA_TWIN[model]}_flex_attn", gate, Eos(eos))
    causal = report(model, SDPA_TWIN[model], gate, None)
    net = built(model, SDPA_TWIN[model], gate)
    e, h = block_causal_reference(net, tokens, eos)
    with torch.no_grad():
        logits = net.output(net.norm(h))
    assert flex["residual_flow_ratio"] == pytest.approx(((h - e).norm() / e.norm()).item(), rel=1e-5)
    assert flex["final_hidden_var"] == pytest.approx(h.pow(2).mean().item(), rel=1e-5)
    assert flex["logits_std"] == pytest.approx(logits.std().item(), rel=1e-5)
    assert flex["final_hidden_var"] != pytest.approx(causal["final_hidden_var"], rel=1e-4)


@pytest.mark.parametrize("model, gate", CASES[1::2])
def test_the_live_diagnostics_of_a_flex_flavor_use_the_trainers_mask(model, gate):
    """LiveDiagnostics given the trainer's masks: with one document per sequence, every
    number equals the SDPA twin's on the same weights (the sink score included: it is
    computed under the mask); with an EOS inside, the residual flow is the per-document
    one and the sink score moves to each document's first token."""
    from gamma_titan.config import Diagnostics
    from gamma_titan.diagnostics import LiveDiagnostics
    from gamma_titan.models.common.masks import trainer_masks

    tokens = probe_batch(model)[:, :48]
    flex, sdpa = built(model, f"{SDPA_TWIN[model]}_flex_attn", gate), built(model, SDPA_TWIN[model], gate)
    cfg = Diagnostics(enable=True)
    one_doc = LiveDiagnostics(cfg, flex, tokens, masks=trainer_masks(flex, tokens, Eos(unused_token(tokens))))
    one_doc = one_doc.activations()
    twin = LiveDiagnostics(cfg, sdpa, tokens).activations()
    assert one_doc.keys() == twin.keys() and any(k.startswith("sink_score/layer_") for k in twin)
    for key, value in twin.items():
        assert one_doc[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key

    eos = tokens[0, 20].item()
    split = LiveDiagnostics(cfg, flex, tokens, masks=trainer_masks(flex, tokens, Eos(eos))).activations()
    e, h = block_causal_reference(sdpa, tokens, eos)
    assert split["residual_flow_ratio"] == pytest.approx(((h - e).norm() / e.norm()).item(), rel=1e-4)
    assert split["sink_score/mean"] != pytest.approx(twin["sink_score/mean"], rel=1e-3)


def test_the_trainers_masks_are_what_the_readers_build():
    """The readers' masks are the model's own `get_attention_masks` (the trainer's call),
    built eagerly: the block mask of the same tokens and EOS, entry for entry."""
    from torch.nn.attention.flex_attention import create_mask

    from gamma_titan.models.common.masks import trainer_masks

    net = built("llama3", "debugmodel_flex_attn", "none")
    tokens = probe_batch("llama3")[:, :64]
    eos = tokens[1, 30].item()
    masks = trainer_masks(net, tokens, Eos(eos))
    dense = create_mask(masks.mask_mod, BATCH, 1, 64, 64, device="cpu")
    assert torch.equal(dense, document_mask(tokens, eos))
    assert trainer_masks(built("llama3", "debugmodel", "none"), tokens, None) is None  # SDPA: causal on its own
    with pytest.raises(ValueError, match="need the run's tokenizer"):
        trainer_masks(net, tokens, None)


@pytest.mark.parametrize("model, flavor", [("llama3", "debugmodel_flex_attn"), ("llama3", "8B_flex"),
                                           ("deepseek_v3", "debugmodel_flex_attn"), ("deepseek_v3", "16B")])
def test_training_a_flex_flavor_on_a_cpu_is_refused_in_one_line(model, flavor, capsys, monkeypatch):
    """Before, the run started and failed at its first backward in torch's own words; a
    GPU launch passes this check. The root logger writes to stderr as on a command line with
    logging set up (TorchTitan's args warn there while pre-flight resolves them: held back)."""
    import logging
    import sys

    from gamma_titan.cli import main
    from gamma_titan.training.preflight import preflight

    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.StreamHandler(sys.stderr)])
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(TITAN_CONFIGS[model]), "--model.flavor", flavor])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"error: model.flavor = {flavor!r}: flex attention has no backward on a CPU (torch {torch.__version__}): "
        "train it on CUDA GPUs, or train an sdpa flavor here (`gamma-titan inspect` runs it on a CPU)\n")
    config = load_job_config(["--job.config_file", str(TITAN_CONFIGS[model]), "--model.flavor", flavor])
    _, args = preflight(config, world_size=1, cuda=True) if flavor.startswith("debug") else titan_args(
        model, "--model.flavor", flavor)
    args.check_training_device(cuda=True)


def test_torch_still_has_no_flex_backward_on_a_cpu():
    """The refusal above holds while torch refuses: the day a torch release trains flex
    attention on a CPU, this fails, and the refusal should go."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, q, q)


@pytest.mark.parametrize("model, flavor, others", [
    ("llama3", "debugmodel_varlen_attn", "405B, 70B, 8B, 8B_flex, debugmodel, debugmodel_flex_attn"),
    ("llama3", "8B_varlen", "405B, 70B, 8B, 8B_flex, debugmodel, debugmodel_flex_attn")])
def test_a_varlen_flavor_is_refused_in_one_line(model, flavor, others, capsys):
    """TorchTitan's varlen attention is a CUDA kernel and the init report runs on the CPU:
    `inspect` died in an AssertionError, a CPU run could not take a step."""
    from gamma_titan.cli import main

    for command in ("inspect", "train"):
        with pytest.raises(SystemExit) as exit_:
            main([command, str(TITAN_CONFIGS[model]), "--model.flavor", flavor])
        assert exit_.value.code == 2
        assert capsys.readouterr().err == (
            f"error: model.flavor = {flavor!r}: varlen attention runs only on CUDA, and the init report runs the "
            f"model on the CPU; {model}'s sdpa and flex flavors: {others}\n")
