"""Value checks of the [gamma] tables, each failing with one ConfigError line that names
the key as the TOML spells it."""

import typing
from dataclasses import fields
from typing import Any

from gamma_titan.data.names import ON_EXHAUSTED
from gamma_titan.errors import ConfigError
from gamma_titan.init import GROUPS
from gamma_titan.models.common import ATTENTION_GATES

from .schema import ON_NONFINITE, Data, Diagnostics, Gamma, ModelArgsOverrides, Reliability
from .titan_keys import is_number

MAX_INIT_RATE = 4.0


def _check_init_rate(key: str, value: Any) -> None:
    if not is_number(value) or not 0 < value <= MAX_INIT_RATE:
        raise ConfigError(f"{key} = {value!r}: must be a number in (0, {MAX_INIT_RATE:g}]")


def check_gamma(gamma: Gamma) -> None:
    if gamma.init_rate is not None:
        _check_init_rate("gamma.init_rate", gamma.init_rate)
    if gamma.norm_eps is not None and (not is_number(gamma.norm_eps) or gamma.norm_eps <= 0):
        raise ConfigError(f"gamma.norm_eps = {gamma.norm_eps!r}: must be a number > 0")
    if gamma.attention_gate is not None and gamma.attention_gate not in ATTENTION_GATES:
        raise ConfigError(
            f"gamma.attention_gate = {gamma.attention_gate!r}: allowed {', '.join(ATTENTION_GATES)}"
        )
    if not is_number(gamma.init_truncation) or gamma.init_truncation < 0:
        raise ConfigError(
            f"gamma.init_truncation = {gamma.init_truncation!r}: must be >= 0 (0 = no truncation)"
        )
    for group in GROUPS:
        value = getattr(gamma.init_rate_overrides, group)
        if value is not None:
            _check_init_rate(f"gamma.init_rate_overrides.{group}", value)
    _check_diagnostics(gamma.diagnostics)
    _check_data(gamma.data)
    _check_reliability(gamma.reliability)


def _check_reliability(r: Reliability) -> None:
    if r.on_nonfinite not in ON_NONFINITE:
        raise ConfigError(f"gamma.reliability.on_nonfinite = {r.on_nonfinite!r}: allowed {', '.join(ON_NONFINITE)}")
    for key, low in (("max_skipped_steps", 0), ("loss_spike_window", 2)):
        value = getattr(r, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"gamma.reliability.{key} = {value!r}: must be an integer >= {low}")
    if not is_number(r.loss_spike_factor) or (r.loss_spike_factor != 0 and r.loss_spike_factor <= 1):
        raise ConfigError(f"gamma.reliability.loss_spike_factor = {r.loss_spike_factor!r}: must be > 1 (0 = off)")
    if not is_number(r.stop_grace_seconds) or r.stop_grace_seconds <= 0:
        raise ConfigError(f"gamma.reliability.stop_grace_seconds = {r.stop_grace_seconds!r}: must be a number > 0")


def _check_data(d: Data) -> None:
    if not isinstance(d.mixture, dict):
        raise ConfigError(f"gamma.data.mixture = {d.mixture!r}: must be a table of folder = weight")
    for name, weight in d.mixture.items():
        if not is_number(weight) or weight < 0:
            raise ConfigError(f"gamma.data.mixture.{name} = {weight!r}: a weight must be a number >= 0")
    if d.mixture and not sum(d.mixture.values()) > 0:
        raise ConfigError("gamma.data.mixture: the weights sum to 0; they must sum to a positive number")
    if not isinstance(d.shuffle, bool):
        raise ConfigError(f"gamma.data.shuffle = {d.shuffle!r}: must be true or false")
    if not isinstance(d.seed, int) or isinstance(d.seed, bool) or d.seed < 0:
        raise ConfigError(f"gamma.data.seed = {d.seed!r}: must be an integer >= 0")
    if d.on_exhausted not in ON_EXHAUSTED:
        raise ConfigError(f"gamma.data.on_exhausted = {d.on_exhausted!r}: allowed {', '.join(ON_EXHAUSTED)}")


def _check_diagnostics(d: Diagnostics) -> None:
    if not isinstance(d.enable, bool):
        raise ConfigError(f"gamma.diagnostics.enable = {d.enable!r}: must be true or false")
    for key, low in (("freq", 1), ("probe_batch", 1), ("cosine_rows", 2)):
        value = getattr(d, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"gamma.diagnostics.{key} = {value!r}: must be an integer >= {low}")
    if not isinstance(d.cosine_params, list) or not all(isinstance(n, str) for n in d.cosine_params):
        raise ConfigError(f"gamma.diagnostics.cosine_params = {d.cosine_params!r}: must be a list of weight names")


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def check_model_args_types(model_args) -> None:
    """Each [model_args] value set must have its field's type (a TOML value is not converted);
    the ranges are the family's checks (models/<family>/args.py, `check`)."""
    hints = typing.get_type_hints(ModelArgsOverrides)
    for f in fields(model_args):
        value = getattr(model_args, f.name)
        if value is None:
            continue
        kinds = [k for k in typing.get_args(hints[f.name]) if k is not type(None)] or [hints[f.name]]
        ok = any(is_number(value) if k is float else
                 isinstance(value, k) and not (k is int and isinstance(value, bool)) for k in kinds)
        if not ok:
            allowed = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            raise ConfigError(f"model_args.{f.name} = {value!r}: must be {allowed}")
