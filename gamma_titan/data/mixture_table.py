"""A mixture table, `{ name = weight, ... }`: the syntax shard folders are mixed by
([gamma.data] mixture, or a mixture file as `dataset_path`) and text sources are mixed by
for a tokenizer (`gamma-titan tokenizer train --mixture`). Names are paths relative to a
base folder (the mixture file's, or the folder the mixture applies to)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gamma_titan.errors import ConfigError

MIXTURE_FILE_SUFFIXES = (".toml", ".json")


def mixture_weights(mixture: Any, key: str) -> dict[str, float]:
    """{name: weight} of a table, checked: weights are numbers >= 0 that sum above 0."""
    if not isinstance(mixture, dict) or not mixture:
        raise ConfigError(f"{key}: must be a table of folder = weight, e.g. {{ web = 0.7, code = 0.3 }}")
    for name, weight in mixture.items():
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{key}.{name} = {weight!r}: a weight must be a number >= 0")
    if not sum(mixture.values()) > 0:
        raise ConfigError(f"{key}: the weights sum to 0; they must sum to a positive number")
    return {name: float(weight) for name, weight in mixture.items()}


def read_mixture_file(path: Path, key: str) -> dict[str, Any]:
    """The table of a mixture file: `mixture = { ... }` or the bare table (TOML or JSON)."""
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
        else:
            import tomllib

            data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ConfigError(f"{key}: mixture file {path} does not parse ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("mixture"), dict) and len(data) == 1:
        data = data["mixture"]
    return data


def parse_mixture_option(value: str, key: str) -> dict[str, Any]:
    """A command line's mixture: an inline table `{ web = 0.7, code = 0.3 }`, or a mixture file."""
    if value.lstrip().startswith("{"):
        import tomllib

        try:
            return tomllib.loads(f"mixture = {value}")["mixture"]
        except ValueError as e:
            raise ConfigError(f"{key}: {value!r} is not a table like {{ web = 0.7, code = 0.3 }} ({e})") from None
    path = Path(value).expanduser()
    if path.suffix not in MIXTURE_FILE_SUFFIXES or not path.is_file():
        raise ConfigError(f"{key}: {value!r} is neither a table like {{ web = 0.7, code = 0.3 }} nor a mixture "
                          f"file ({', '.join(MIXTURE_FILE_SUFFIXES)}) that exists")
    return read_mixture_file(path, key)
