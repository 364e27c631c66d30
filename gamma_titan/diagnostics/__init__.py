"""The paper's instruments: sink score, residual flow, ε-saturation, gate statistics,
stable rank and row-cosine condensation, live in training and offline."""

from .live import LiveDiagnostics, build_probe_batch, cosine_due, diagnostics_due
from .probe import ActivationProbe
from .sink import first_token_mass
from .spectral import StableRanks, leading_rows, row_cosine, spectral_norm

__all__ = ["ActivationProbe", "LiveDiagnostics", "StableRanks", "build_probe_batch", "cosine_due",
           "diagnostics_due", "first_token_mass", "leading_rows", "row_cosine", "spectral_norm"]
