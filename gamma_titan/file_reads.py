"""Reading the files a command did not write this time (tokenizers, shard folders, progress
and run records, checkpoints' model records, recipe records) so that a damaged or truncated
one is refused in one line naming the file, what is wrong with it and what to do, before the
command writes anything: never a traceback from deep inside a parser.

A leaf module beside files.py: every layer reads through it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gamma_titan.errors import ConfigError


def damaged(path: Path | str, what: str, hint: str) -> ConfigError:
    return ConfigError(f"{path}: {what}; {hint}")


def read_text(path: Path | str, hint: str) -> str:
    path = Path(path)
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise damaged(path, f"damaged: byte {e.start} is not UTF-8 text", hint) from None
    except FileNotFoundError:
        raise damaged(path, "missing", hint) from None
    except OSError as e:
        raise damaged(path, f"cannot be read ({e.strerror})", hint) from None


def read_json(path: Path | str, hint: str, keys: tuple[str, ...] | None = None) -> Any:
    """The JSON in `path`; with `keys`, an object that has each of them (`()`: any object)."""
    text = read_text(path, hint)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        where = "cut short" if e.pos >= len(text.rstrip()) else f"damaged at line {e.lineno}, column {e.colno}"
        raise damaged(path, f"JSON {where} ({e.msg})", hint) from None
    if keys is not None:
        if not isinstance(data, dict):
            raise damaged(path, f"holds a JSON {type(data).__name__}, not the object expected", hint)
        missing = [k for k in keys if k not in data]
        if missing:
            raise damaged(path, f"has no {', '.join(repr(k) for k in missing)}", hint)
    return data


def read_json_lines(path: Path | str, hint: str) -> list[Any]:
    """One JSON value per non-empty line (metrics.jsonl and the like)."""
    out = []
    for number, line in enumerate(read_text(path, hint).splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise damaged(path, f"line {number} is not JSON ({e.msg})", hint) from None
    return out


def read_toml(path: Path | str, hint: str) -> dict[str, Any]:
    import tomllib

    text = read_text(path, hint)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise damaged(path, f"damaged TOML ({e})", hint) from None


def load_tokenizer(path: Path | str, hint: str):
    """A `tokenizers` Tokenizer from its tokenizer.json."""
    from tokenizers import Tokenizer

    read_json(path, hint)  # a parse error named by us, not by the Rust deserializer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001  (tokenizers raises a bare Exception)
        raise damaged(path, f"not a tokenizer `tokenizers` can load ({str(e).splitlines()[0][:160]})", hint) from None


def load_npy(path: Path | str, hint: str, mmap: bool = False):
    """A .npy array (np.load), memory-mapped with `mmap`."""
    import numpy as np

    path = Path(path)
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise damaged(path, "missing", hint) from None
    except (ValueError, EOFError, OSError) as e:
        raise damaged(path, f"damaged or truncated .npy ({str(e).splitlines()[0][:160]})", hint) from None
