"""Scaling-law fits: L(N) = E + A·N^(−α), and the effective model-size gain between two laws.

The fit is least squares on the losses. For a fixed α the model is linear in (E, A), so
each α is solved exactly and only α is searched: a grid, then a bounded scalar refinement.
N is divided by its geometric mean first so the columns are well conditioned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALPHA_RANGE = (1e-3, 3.0)


@dataclass(frozen=True)
class PowerLaw:
    E: float
    A: float
    alpha: float

    def __call__(self, n):
        return self.E + self.A * np.asarray(n, dtype=float) ** -self.alpha

    def size_for(self, loss: float) -> float:
        """The N at which this law reaches `loss` (inf at or below its floor E, past what a
        float holds, or when the law does not fall with N)."""
        if loss <= self.E or self.A <= 0:
            return math.inf
        log_n = math.log(self.A / (loss - self.E)) / self.alpha
        return math.exp(log_n) if log_n < 700 else math.inf


def _solve(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[float, float, float]:
    design = np.stack([np.ones_like(x), x ** -alpha], axis=1)
    (e, a), *_ = np.linalg.lstsq(design, y, rcond=None)
    sse = float(np.sum((design @ np.array([e, a]) - y) ** 2))
    return float(e), float(a), sse


def _grid_sse(x: np.ndarray, y: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """The least-squares error at each α of the grid at once (simple regression of y on x^−α)."""
    z = x[None, :] ** -alphas[:, None]
    zc = z - z.mean(axis=1, keepdims=True)
    yc = y - y.mean()
    a = (zc @ yc) / np.maximum((zc * zc).sum(axis=1), 1e-300)
    return ((yc[None, :] - a[:, None] * zc) ** 2).sum(axis=1)


def fit_power_law(n, loss) -> PowerLaw:
    """Least-squares fit of L(N) = E + A·N^(−α) to three or more (N, L) points."""
    from scipy.optimize import minimize_scalar

    n, y = np.asarray(n, dtype=float), np.asarray(loss, dtype=float)
    if n.shape != y.shape or n.size < 3:
        raise ValueError(f"a power-law fit needs three or more (N, loss) points, got {n.size}")
    if np.any(n <= 0):
        raise ValueError("parameter counts must be positive")
    scale = math.exp(float(np.mean(np.log(n))))
    x = n / scale
    grid = np.geomspace(*ALPHA_RANGE, 400)
    errors = _grid_sse(x, y, grid)
    i = int(np.argmin(errors))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    best = minimize_scalar(lambda a: _solve(x, y, a)[2], bounds=(lo, hi), method="bounded",
                           options={"xatol": 1e-10})
    alpha = float(best.x) if best.fun <= errors[i] else float(grid[i])
    e, a, _ = _solve(x, y, alpha)
    return PowerLaw(E=e, A=a * scale ** alpha, alpha=alpha)


def effective_size_gain(baseline: PowerLaw, improved: PowerLaw, n: float) -> float:
    """How many times the parameters the baseline needs to reach the improved model's loss
    at size n: N_baseline(L_improved(n)) / n. 1.79 is the paper's "79% more"; inf when the
    improved loss lies below the baseline's floor E."""
    return baseline.size_for(float(improved(n))) / n
