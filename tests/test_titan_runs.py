"""TorchTitan's models with the paper's knobs, trained: a checkpoint converts to Hugging Face
with the same logits, to transformers' own class where the knobs allow it. (Their FSDP, TP,
PP and DDP runs against one process: the family matrix, tests/test_families.py.) One module
fixture trains each (model, layout) once."""

import json

import pytest
import torch

from titan_cases import SMALL_BATCH, TITAN_CONFIGS


#: The gated llama3 and qwen3 (GammaForCausalLM) convert in the family matrix
#: (tests/test_families.py); deepseek_v3's there routes round-robin, its expert bias untrained.
HF_CLASSES = {("llama3", "none"): "LlamaForCausalLM", ("qwen3", "none"): "Qwen3ForCausalLM",
              ("deepseek_v3", "elementwise"): "GammaForCausalLM"}


@pytest.mark.parametrize("model, gate", sorted(HF_CLASSES))
def test_trained_checkpoint_converts_to_hf_with_the_same_logits(model, gate, titan_run, tmp_path, capsys):
    """A trained checkpoint: without the gate TorchTitan's mapping to transformers' own class
    (Llama, Qwen3; ε = 1e-12 in its config), with it our GammaForCausalLM (Llama 3.1 RoPE
    scaling, Qwen's q/k norms, head width and tied head, DeepSeek's MLA, trained expert bias
    and softmax routing included), which `convert` names with its reason; transformers'
    logits equal the model's to 1e-4. (deepseek_v3's ungated and sigmoid-routed forms:
    test_titan.py, on random weights.)"""
    transformers = pytest.importorskip("transformers")
    from gamma_titan.convert.dcp_io import load_model_state
    from gamma_titan.convert.hf import to_hf
    from gamma_titan.convert.model_record import read_model_record
    from gamma_titan.models import TRAIN_SPECS

    step = titan_run(model, "single" if gate == "elementwise" else "ungated") / "checkpoint" / "step-4"
    name, args, _ = read_model_record(step)
    assert name == model and args.attention_gate == gate and args.init.rate == 1.0
    net = TRAIN_SPECS[model].model_cls(args)
    net.load_state_dict(load_model_state(step))
    folder = to_hf(step, tmp_path / "hf", progress=True)
    note = f"{model} -> GammaForCausalLM (load with trust_remote_code=True): the attention gate"
    assert (note in capsys.readouterr().err) == (gate != "none")
    config = json.loads((folder / "config.json").read_text())
    hf_class = HF_CLASSES[model, gate]
    assert config["architectures"] == [hf_class] and config["rms_norm_eps"] == 1e-12
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True)
    assert type(hf).__name__ == hf_class
    seq = min(96, args.max_seq_len)  # the rotary table's length (qwen3 here: trained at 64)
    tokens = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = net(tokens), hf(tokens).logits
    assert ours.abs().max() > 1e-3  # trained logits, not a zero model
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def titan_run(tmp_path_factory, builtin_assets):
    """`titan_run(model, layout)`: the dump folder of 4 deterministic steps of the model's
    debug config with γ-init, ε and the gate, validated at steps 1 and 4, on one process
    ("single", which also checkpoints step 4) or without the gate ("ungated", checkpointed
    too). Each runs once, when first asked for."""
    from helpers import QUIET, run_trainer

    checkpoint = ("--checkpoint.enable", "true", "--checkpoint.interval", "4")
    layouts = {"single": checkpoint, "ungated": (*checkpoint, "--gamma.attention_gate", "none")}
    dumps = {}

    def run(model: str, layout: str):
        if (model, layout) not in dumps:
            extra = layouts[layout]
            dump = tmp_path_factory.mktemp(f"{model}_{layout}") / "run"
            run_trainer(dump, *QUIET, "--training.steps", "4", "--debug.deterministic", "true",
                        "--optimizer.weight_decay_policy", "megatron",
                        "--validation.enable", "true", "--validation.freq", "4", "--validation.steps", "2",
                        *SMALL_BATCH[model], *extra,
                        config=TITAN_CONFIGS[model])
            dumps[model, layout] = dump
        return dumps[model, layout]

    return run
