"""The paper's knobs on TorchTitan's own models: `[model] name = "llama3"` with a `[gamma]`
table. Each module is one of TorchTitan's families, registered under TorchTitan's name
(so TorchTitan's trainer and ours both build it); without [gamma] knobs it is
TorchTitan's model bit for bit. knobs.py holds what they share."""

from gamma_titan.models.registry import register_family

from . import llama3

register_family("llama3", llama3.train_spec())
