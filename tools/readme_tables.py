"""The parts of README.md that the model registry decides, written from it: nobody edits
them by hand, and a family's author runs this once after adding the family.

- The flavor tables: under each line `<!-- flavors: NAME ... -->`, a table of family NAME's
  flavors: one column per `[model_args]` field whose value differs between them (every field
  for a family of one flavor), then the parameter count with the elementwise gate, the
  active parameters where the family has experts (`active_params`) and the training FLOPs
  per token at seq 2048. A family gets a table where the README has its marker line; one
  without is not listed (its flavors are in its args.py).
- The Layout's entries of the folders of gamma_titan/models/ that hold families: the
  families registered from the folder, the first sentence of its `__init__.py` docstring,
  and its files. The other folders' entries (common/) are written by hand and kept.

Only the package's own families are listed (in TRAIN_SPECS, with their model in
gamma_titan.models), never the ones other packages install by entry points.

    python tools/readme_tables.py           # check: exit 1 naming the stale sections
    python tools/readme_tables.py --write   # rewrite them in README.md
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import math
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MODELS = REPO / "gamma_titan" / "models"

#: What a family's author runs after adding it (README "Adding a model family" names it).
COMMAND = "python tools/readme_tables.py --write"

#: A flavor table's marker line (the family's name, then anything up to `-->`) and the form
#: the generator writes it in.
MARKER = re.compile(r"^<!-- flavors: ([\w.-]+)\b.*-->$")
MARKER_LINE = "<!-- flavors: {name} (written by " + COMMAND + ") -->"

#: The sequence length of the FLOPs column.
FLOPS_SEQ = 2048

#: The Layout block: where the models/ entries' text starts and how wide it wraps.
LAYOUT_TEXT_COLUMN = 21
LAYOUT_WIDTH = 100


# --- the registry -------------------------------------------------------------------


def own_families(registry: dict | None = None, installed: set[str] | None = None) -> dict[str, object]:
    """{name: TrainSpec} of the package's own families: registered in TRAIN_SPECS (or
    `registry`), with the model class in gamma_titan.models, and not installed by an entry
    point of the group `gamma_titan.families` (or named in `installed`), whatever classes
    such a family reuses."""
    from importlib.metadata import entry_points

    from gamma_titan.models import FAMILY_ENTRY_POINTS, TRAIN_SPECS

    registry = TRAIN_SPECS if registry is None else registry
    if installed is None:
        installed = {entry.name for entry in entry_points(group=FAMILY_ENTRY_POINTS)}
    return {name: spec for name, spec in registry.items()
            if name not in installed and spec.model_cls.__module__.startswith("gamma_titan.models.")}


def family_folder(spec) -> str:
    """The folder of gamma_titan/models/ a family's model lives in."""
    return spec.model_cls.__module__.split(".")[2]


# --- the flavor tables --------------------------------------------------------------


def count(n: float) -> str:
    """Three significant digits, with k (thousands), M (millions) or B (from 0.1 billion)."""
    for unit, floor, scale in (("B", 1e8, 1e9), ("M", 1e6, 1e6), ("k", 1e3, 1e3)):
        if n >= floor:
            return significant(n / scale) + unit
    return significant(n)


def significant(x: float, digits: int = 3) -> str:
    """x to `digits` significant digits, written without an exponent ("0.0526", "17.1", "109")."""
    if x == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    text = f"{x:.{decimals}f}"
    if decimals and len(text.replace(".", "").lstrip("0-")) > digits:  # rounded up a digit (9.996 -> 10.00)
        text = f"{x:.{decimals - 1}f}"
    return text


def field_cell(value) -> str:
    """A field's value as a table cell: None as "—", a whole float without its ".0"."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def table_fields(flavors: dict) -> list[str]:
    """The `[model_args]` fields that differ between the flavors (every one for one flavor)."""
    args = next(iter(flavors.values()))
    names = (type(args).model_args_fields() if hasattr(type(args), "model_args_fields")
             else tuple(f.name for f in dataclasses.fields(args) if not f.name.startswith("_")))
    if len(flavors) == 1:
        return list(names)
    return [n for n in names if len({repr(getattr(a, n)) for a in flavors.values()}) > 1]


def param_shapes(spec, args) -> tuple | None:
    """The names and shapes of a flavor's parameters, its model built on the meta device;
    None where it does not build."""
    import torch

    try:
        with torch.device("meta"):
            return tuple((n, tuple(p.shape)) for n, p in spec.model_cls(args).named_parameters())
    except Exception:  # noqa: BLE001  (a shape that does not build differs from one that does)
        return None


def counts(args) -> tuple[str | None, int | None, float | None]:
    """What the args say of their shape: the attention kinds (heads, head widths), the active
    parameters and the GFLOP a token costs at FLOPS_SEQ (None for a count the args lack)."""
    attention = repr(args.attention_shapes()) if hasattr(args, "attention_shapes") else None
    active = args.active_params() if hasattr(args, "active_params") else None
    try:
        flops = args.flops_per_token(FLOPS_SEQ) / 1e9
    except NotImplementedError:
        flops = None
    return attention, active, flops


def uses(spec, args, field: str, shapes: tuple | None) -> bool:
    """Whether a flavor's shape uses an integer field: changing it changes its `counts` or,
    failing that, its parameters' shapes (`shapes`: the flavor's own). MLA's ranks and head
    widths on an MHA flavor do not, nor does the rotary cache's length. A field of another
    type is always shown."""
    value = getattr(args, field)
    if not isinstance(value, int) or isinstance(value, bool):
        return True
    changed = copy.deepcopy(args)
    setattr(changed, field, 2 * value if value > 0 else 1)
    try:
        if counts(changed) != counts(args):
            return True
    except Exception:  # noqa: BLE001  (a value the args cannot take: the field matters)
        return True
    return param_shapes(spec, changed) != shapes


def flavor_rows(spec) -> tuple[list[str], list[list[str]]]:
    """The header and the rows of a family's flavor table: a cell of a field the flavor's
    shape does not use is left empty, and a column empty in every row left out."""
    flavors = {name: copy.deepcopy(spec.model_args[name]) for name in spec.model_args}  # never the registry's
    for args in flavors.values():
        if hasattr(args, "attention_gate"):
            args.attention_gate = "elementwise"
    shapes = {name: param_shapes(spec, args) for name, args in flavors.items()}
    if broken := [name for name, held in shapes.items() if held is None]:
        raise ValueError(f"flavors {broken} of {spec.model_cls.__name__} do not build on the meta device")
    fields = table_fields(flavors)
    cells = {f: [field_cell(getattr(a, f)) if uses(spec, a, f, shapes[n]) else "" for n, a in flavors.items()]
             for f in fields}
    fields = [f for f in fields if any(cells[f])]
    header = ["flavor", *fields, "params (elementwise gate)"]
    rows = [[name, *(cells[f][i] for f in fields), count(sum(math.prod(s) for _, s in shapes[name]))]
            for i, name in enumerate(flavors)]
    _, actives, flops = zip(*(counts(args) for args in flavors.values()))
    if any(active is not None for active in actives):
        header.append("active (`active_params`)")
        for row, active in zip(rows, actives):
            row.append("—" if active is None else count(active))
    if all(value is not None for value in flops):
        header.append(f"GFLOP/token (seq {FLOPS_SEQ})")
        for row, value in zip(rows, flops):
            row.append(significant(value))
    return header, rows


def flavor_table(name: str, families: dict | None = None) -> list[str]:
    """The markdown lines of family `name`'s flavor table, its marker line first."""
    families = own_families() if families is None else families
    if name not in families:
        raise ValueError(f"README.md has a flavor table for {name!r}, which is not one of the package's "
                         f"families ({', '.join(families)}): remove its `<!-- flavors: {name} -->` line")
    header, rows = flavor_rows(families[name])
    line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return [MARKER_LINE.format(name=name), line(header), "|" + "---|" * len(header), *map(line, rows)]


def write_flavor_tables(lines: list[str], families: dict) -> list[str]:
    """`lines` with the table under each marker line (the table lines right after it)
    replaced by the generated one."""
    out, i = [], 0
    while i < len(lines):
        match = MARKER.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        out += flavor_table(match[1], families)
        i += 1
        if i + 1 < len(lines) and not lines[i].strip() and lines[i + 1].startswith("|"):
            i += 1  # a table a blank line below its marker: the same table
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        if i < len(lines) and lines[i].strip():
            out.append("")  # a table needs a blank line before the text that follows
    return out


# --- the Layout -----------------------------------------------------------------------


def folder_summary(folder: Path) -> str:
    """The first sentence of the folder's `__init__.py` docstring (a full stop followed by a
    space, outside brackets and backticks), without its full stop; "" without one."""
    init = folder / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) if init.is_file() else None
    text = " ".join((doc or "").split())
    depth, code = 0, False
    for i, c in enumerate(text):
        code ^= c == "`"
        depth += (c in "([{") - (c in ")]}")
        if c == "." and not depth and not code and (i + 1 == len(text) or text[i + 1] == " "):
            return text[:i]
    return text


def folder_files(folder: Path) -> list[str]:
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                  if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py"))


def layout_entry(folder: str, names: list[str], models: Path = MODELS) -> list[str]:
    """The Layout lines of a folder that holds families: who registers from it, what it is
    (its docstring's first sentence), its files."""
    summary = folder_summary(models / folder)
    if not all(name in summary for name in names):
        summary = ", ".join(names) + (f": {summary}" if summary else "")
    indent = " " * LAYOUT_TEXT_COLUMN
    wrap = lambda text: textwrap.wrap(text, LAYOUT_WIDTH - LAYOUT_TEXT_COLUMN, break_long_words=False,  # noqa: E731
                                      break_on_hyphens=False)
    text = wrap(summary) + wrap(", ".join(folder_files(models / folder)))
    head = f"    {folder}/".ljust(LAYOUT_TEXT_COLUMN - 1) + " "
    return [head + text[0], *(indent + line for line in text[1:])]


def models_span(lines: list[str]) -> tuple[int, int]:
    """[start, end) of the models/ folders' entries in the README's Layout block: the lines
    indented 4 or more after the `  models/` entry's own, up to the next entry of its level."""
    layout = lines.index("## Layout")
    fence = next(i for i in range(layout, len(lines)) if lines[i].startswith("```"))
    models = next(i for i in range(fence, len(lines)) if lines[i].startswith("  models/"))
    start = next(i for i in range(models + 1, len(lines)) if not lines[i].startswith(" " * (LAYOUT_TEXT_COLUMN - 1)))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("    "))
    return start, end


def write_layout(lines: list[str], families: dict, models: Path = MODELS) -> list[str]:
    """`lines` with the entries of the models/ folders that hold families generated, the
    other folders' entries kept as written, all in order of name."""
    start, end = models_span(lines)
    entries, current = {}, None
    for line in lines[start:end]:
        if line[4] != " ":
            current = line.split()[0]
            entries[current] = []
        entries[current].append(line)
    by_folder: dict[str, list[str]] = {}
    for name, spec in families.items():
        by_folder.setdefault(family_folder(spec), []).append(name)
    entries = {k: v for k, v in entries.items() if k.removesuffix("/") not in by_folder}
    entries |= {f"{folder}/": layout_entry(folder, names, models) for folder, names in by_folder.items()}
    return lines[:start] + [line for key in sorted(entries) for line in entries[key]] + lines[end:]


# --- the whole README -----------------------------------------------------------------


def generate(text: str, families: dict | None = None, models: Path = MODELS) -> str:
    """The README text with every generated section rewritten from the registry (by default
    the package's own families)."""
    families = own_families() if families is None else families
    lines = write_flavor_tables(text.split("\n"), families)
    return "\n".join(write_layout(lines, families, models))


def diff(old: str, new: str) -> str:
    """A unified diff of the README's text against the generated one ("" when equal)."""
    import difflib

    return "\n".join(difflib.unified_diff(old.split("\n"), new.split("\n"), "README.md", "generated",
                                          lineterm="", n=0))


def stale_diff(text: str, families: dict | None = None) -> str:
    """How the generated sections of the README differ from what the registry gives: a
    unified diff, "" when the README is up to date."""
    return diff(text, generate(text, families))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the generated sections in place")
    parser.add_argument("--readme", type=Path, default=README, help="the README (default: the repository's)")
    args = parser.parse_args(argv)
    text = args.readme.read_text(encoding="utf-8")
    try:
        new = generate(text)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.write:
        if new != text:
            args.readme.write_text(new, encoding="utf-8")
        print(f"{args.readme}: {'rewritten' if new != text else 'up to date'}")
        return 0
    if new != text:
        print(f"{args.readme} is stale; run: {COMMAND}\n{diff(text, new)}", file=sys.stderr)
        return 1
    print(f"{args.readme}: up to date")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # run from a checkout without the package installed
    sys.exit(main())
