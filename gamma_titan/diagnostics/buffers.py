"""Forwards that must leave no trace in training: an evaluation or a measurement runs the
model, whose MoE layers add to their load counters (`tokens_per_expert`, the expert bias's
next step, and the logged load) on every forward, training or not. Every buffer is copied
back afterwards, so a run that validates or measures trains bitwise as one that does not."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def buffers_restored(*models: nn.Module):
    saved = [[b.clone() for b in model.buffers()] for model in models]
    try:
        yield
    finally:
        with torch.no_grad():
            for model, copies in zip(models, saved):
                for buffer, copy in zip(model.buffers(), copies):
                    buffer.copy_(copy)
