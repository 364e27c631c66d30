"""The TOML tables gamma_titan adds to TorchTitan's JobConfig: [gamma] (the paper's knobs,
diagnostics, data, reliability), [model_args] (any field of the model's flavor), and one
key of [optimizer] (weight_decay_policy).

Each field's docstring is its documentation; the choices of a `Literal` come from the
tuple its owner defines (the gate from models/common/attention.py, the data's end from
data/names.py; the guard's action is defined here).
"""

import typing
from dataclasses import dataclass, field, make_dataclass
from typing import Literal

from gamma_titan.data.names import ON_EXHAUSTED
from gamma_titan.init import GROUPS
from gamma_titan.models import TRAIN_SPECS
from gamma_titan.models.common import ATTENTION_GATES


#: [gamma.init_rate_overrides]: γ for one parameter group (gamma_titan/init.py), for
#: ablations; unset groups use gamma.init_rate.
InitRateOverrides = make_dataclass("InitRateOverrides", [(g, float | None, field(default=None)) for g in GROUPS])


@dataclass
class Diagnostics:
    """The paper's instruments, logged live as gamma/* (see gamma_titan/diagnostics)."""

    enable: bool = False
    """Measure at step 1 and every `freq` steps; false switches all of it off."""
    freq: int = 100
    """Steps between measurements (row-cosine maps: every 10 x freq)."""
    probe_batch: int = 4
    """Sequences in the fixed probe batch (the first of the validation dataset)."""
    cosine_rows: int = 256
    """Rows of each matrix in a row-cosine map (the first ones)."""
    cosine_params: list[str] = field(default_factory=list)
    """Weights to draw row-cosine maps of; empty = wo and the first FFN w1 of the first and last block."""


@dataclass
class Data:
    """How the shard datasets ("builtin", "memmap") are read (see gamma_titan/data/shard_sources.py)."""

    mixture: dict[str, float] = field(default_factory=dict)
    """Weights over the shard folders in dataset_path, e.g. { web = 0.7, code = 0.3 }; empty = one folder."""
    shuffle: bool = True
    """Training sequences in a fresh seeded order each epoch; false reads them in stream order."""
    seed: int = 0
    """Seed of that order (source i of a mixture uses seed + i)."""
    on_exhausted: Literal[ON_EXHAUSTED] = "wrap"
    """At the end of the data: start a new epoch (logged), or stop training cleanly."""


#: What a non-finite step does (gamma.reliability.on_nonfinite): skip its update, or stop
#: (gamma_titan/training/step_guard.py).
ON_NONFINITE = ("skip", "stop")


@dataclass
class Reliability:
    """What a long run does about bad steps and preemption (gamma_titan/training/step_guard.py, graceful_stop.py, checkpoint_folders.py)."""

    on_nonfinite: Literal[ON_NONFINITE] = "skip"
    """A NaN/Inf loss or gradient norm: skip the step (no update, logged) or stop the run, naming the step."""
    max_skipped_steps: int = 10
    """Skipped steps one run may accumulate before it stops anyway."""
    loss_spike_factor: float = 1.5
    """Log a step (with its data position) whose loss exceeds this many times the running mean; 0 = off."""
    loss_spike_window: int = 50
    """Steps in that running mean (no spike is logged before the window is full)."""
    stop_grace_seconds: float = 300.0
    """After SIGTERM: checkpoint the current step and exit 0; exit 143 if that takes longer than this."""


@dataclass
class Gamma:
    """The paper's three knobs. Each one left unset keeps the model's own choice: for
    gamma_dense / gamma_moe the paper's (γ = 1, ε = 1e-12, elementwise gate), for
    TorchTitan's models TorchTitan's (its init, its flavor's ε, no gate)."""

    init_rate: float | None = None
    """γ: every weight matrix W ~ N(0, d_in^(-2γ)). 0.5 = standard scale, 1 = the paper's balance point."""
    norm_eps: float | None = None
    """ε of every RMSNorm in the model. Must sit far below d^(-2γ), the hidden variance at init."""
    attention_gate: Literal[ATTENTION_GATES] | None = None
    """Sigmoid gate on each head's attention output: none, one per head, or one per channel."""
    init_truncation: float = 0.0
    """Truncate the init normal at ± this many σ; 0 draws a plain normal, as in the paper."""
    init_rate_overrides: InitRateOverrides = field(default_factory=InitRateOverrides)
    diagnostics: Diagnostics = field(default_factory=Diagnostics)
    data: Data = field(default_factory=Data)
    reliability: Reliability = field(default_factory=Reliability)


def _model_args_overrides():
    """[model_args]: any field of the registered families' args (each optional: unset
    keeps the flavor's value); the paper's knobs come from [gamma] instead. Which fields
    apply to the chosen model is checked when they are applied (GammaArgs)."""
    specs = {}
    for spec in TRAIN_SPECS.values():
        args_cls = type(next(iter(spec.model_args.values())))
        hints = typing.get_type_hints(args_cls)
        for name in args_cls.model_args_fields():
            specs.setdefault(name, (name, hints[name] | None, field(default=None)))
    return make_dataclass("ModelArgsOverrides", list(specs.values()))


ModelArgsOverrides = _model_args_overrides()


#: [optimizer] weight_decay_policy (gamma_titan/training/optimizer.py).
WEIGHT_DECAY_POLICIES = ("all", "megatron")


@dataclass
class Optimizer:
    """gamma-titan's addition to TorchTitan's [optimizer] (its optimizer builder reads only
    that table)."""

    weight_decay_policy: Literal[WEIGHT_DECAY_POLICIES] = "all"
    """Which parameters AdamW decays: all (TorchTitan's choice), or megatron (Megatron-LM's, the paper's: not the biases and 1-D parameters, i.e. the norm scales)."""


@dataclass
class JobConfig:
    gamma: Gamma = field(default_factory=Gamma)
    model_args: ModelArgsOverrides = field(default_factory=ModelArgsOverrides)
    optimizer: Optimizer = field(default_factory=Optimizer)
