"""Default corpora that every Python installation already has: CPython's own docs and code.

Nothing is downloaded and no text is stored in this repository. Two sources:
  docs  the `help()` topic texts (`pydoc_data.topics.topics`), one document per topic, and
        the docstrings of the standard library, one document per module: the module
        docstring followed by the docstrings of its classes, methods and functions, each
        under a header line with its qualified name (≈ 1M tokens at a 512-token vocabulary);
  code  the standard library's source files themselves, test suites included, one document
        per module (≈ 18M tokens at that vocabulary: what single-epoch runs at the recipes'
        CPU scale need, mixed with the docs by `[gamma.data] mixture`).
Standard-library sources are read as text (docs: parsed with `ast`) and never imported, so
building a corpus runs no library code and has no side effects.

The output is deterministic for a given Python installation: documents are sorted by title,
and the held-out validation split is chosen by a stable hash of the title (not by position),
so adding or removing one module never moves other documents between splits. A module's
docs and code documents share its title, hence its split: no docstring of a validation
module is trained on through the code.
"""

from __future__ import annotations

import ast
import io
import json
import logging
import pkgutil
import platform
import re
import sys
import sysconfig
import tokenize
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from gamma_titan.data.cache import build_once, cache_dir
from gamma_titan.data.names import BUILTIN_DOCS, BUILTIN_SOURCES

logger = logging.getLogger(__name__)

# Bump when a source's generated text changes, so readers of meta.json can tell builds apart.
FORMAT_VERSION = {"docs": 2, "code": 1}
#: Each source's cache name stem (the docs one predates the code source).
_STEMS = {"docs": "pydocs", "code": "pycode"}

# Documents shorter than this (after whitespace normalisation) are mostly boilerplate.
MIN_DOC_CHARS = 200

# About 10% of documents (by title hash) are held out for validation: enough tokens for a
# validation loss that is not noise, and for every data-parallel rank to get samples.
VALIDATION_MODULUS = 10

# Package or module names whose subtree is skipped: test suites, GUI tooling, demo code and
# deprecated converters are not representative prose, and site-packages is not the stdlib.
SKIPPED_NAMES = frozenset(
    {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages"}
)

TRAIN_FILE = "train.jsonl"
VALIDATION_FILE = "validation.jsonl"
META_FILE = "meta.json"


@dataclass(frozen=True)
class Document:
    title: str  # unique; also the first line of `text`
    text: str


def corpus_name(source: str = BUILTIN_DOCS) -> str:
    """Names a cached corpus and everything derived from it (the built-in tokenizer is the
    docs corpus's): a new Python or a new corpus format gives a new name, so a stale cache
    is never read."""
    return f"{_STEMS[source]}-{python_tag()}-v{FORMAT_VERSION[source]}"


def python_tag() -> str:
    """`<major>.<minor>` of the running interpreter, e.g. "3.11"."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def is_validation(title: str) -> bool:
    """Stable split assignment: depends only on the title, not on order or other documents."""
    return zlib.crc32(title.encode("utf-8")) % VALIDATION_MODULUS == 0


def normalise_whitespace(text: str) -> str:
    """Expand tabs, drop trailing spaces, collapse runs of blank lines, strip the ends.

    Indentation inside lines is kept on purpose: docstrings contain code examples.
    """
    lines = [line.rstrip() for line in text.expandtabs(4).splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


# --------------------------------------------------------------------------- help() topics


def _topic_documents() -> Iterator[Document]:
    # pydoc_data.topics is a pure data module (one dict of strings); importing it is safe.
    from pydoc_data.topics import topics

    for name, body in topics.items():
        title = f"topic: {name}"
        yield Document(title, normalise_whitespace(f"{title}\n\n{body}"))


# --------------------------------------------------------------------------- stdlib docstrings


def _stdlib_sources(root: Path) -> Iterator[tuple[str, Path]]:
    """Yield (qualified module name, source file) for the stdlib under `root`, unimported.

    `pkgutil.iter_modules` lists one folder's modules without importing anything; we recurse
    into packages ourselves (unlike `walk_packages`, which imports them).
    """

    def walk(folder: Path, prefix: str) -> Iterator[tuple[str, Path]]:
        for info in pkgutil.iter_modules([str(folder)]):
            if info.name in SKIPPED_NAMES:
                continue
            qualname = prefix + info.name
            if info.ispkg:
                source = folder / info.name / "__init__.py"
                if source.is_file():
                    yield qualname, source
                yield from walk(folder / info.name, qualname + ".")
            else:
                source = folder / f"{info.name}.py"
                if source.is_file():  # skips compiled extension modules
                    yield qualname, source

    yield from walk(root, "")


def _docstring_sections(tree: ast.Module, module_name: str) -> Iterator[tuple[str, str]]:
    """Yield (qualified name, docstring) for the module and its classes/functions.

    Functions nested inside functions are skipped: they are implementation details.
    """
    doc = ast.get_docstring(tree)
    if doc:
        yield module_name, doc

    def visit(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, str]]:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}.{node.name}"
                doc = ast.get_docstring(node)
                if doc:
                    yield qualname, doc
                if isinstance(node, ast.ClassDef):
                    yield from visit(node.body, qualname)

    yield from visit(tree.body, module_name)


def _module_documents(root: Path) -> Iterator[Document]:
    for module_name, source in _stdlib_sources(root):
        try:
            # Bytes, so ast honours the file's encoding declaration.
            tree = ast.parse(source.read_bytes(), filename=str(source))
        except (SyntaxError, ValueError, OSError) as err:
            logger.debug("skipping %s: %s", source, err)
            continue
        sections = [f"{name}\n{doc}" for name, doc in _docstring_sections(tree, module_name)]
        if not sections:
            continue
        # The module's own name heads the document even if it has no module docstring.
        if not sections[0].startswith(f"{module_name}\n"):
            sections.insert(0, module_name)
        yield Document(module_name, normalise_whitespace("\n\n".join(sections)))


# --------------------------------------------------------------------------- stdlib code

#: Folders of the stdlib tree that are not its code: installed packages, and the generated
#: data module that holds the help() topics (the docs source's text).
CODE_SKIPPED_FOLDERS = frozenset({"site-packages", "pydoc_data"})


def _code_documents(root: Path) -> Iterator[Document]:
    """Every .py file under the stdlib root, as text in its declared encoding, titled by
    its module name (`email/message.py` -> `email.message`, `json/__init__.py` -> `json`)."""
    for source in sorted(root.rglob("*.py")):
        rel = source.relative_to(root)
        if CODE_SKIPPED_FOLDERS & set(rel.parts[:-1]):
            continue
        parts = rel.with_suffix("").parts
        title = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
        try:
            # tokenize.open honours the file's coding declaration, as the interpreter does.
            with tokenize.open(source) as f:
                text = f.read()
        except (SyntaxError, UnicodeDecodeError, OSError) as err:  # a few test files are invalid on purpose
            logger.debug("skipping %s: %s", source, err)
            continue
        yield Document(title, normalise_whitespace(f"# {title}\n{text}"))


# --------------------------------------------------------------------------- corpus


def collect_documents(stdlib_root: str | Path | None = None, source: str = BUILTIN_DOCS) -> list[Document]:
    """All documents of a source ("docs" or "code"), long enough to keep, sorted by title."""
    root = Path(stdlib_root or sysconfig.get_paths()["stdlib"])
    found = (*_topic_documents(), *_module_documents(root)) if source == BUILTIN_DOCS else _code_documents(root)
    docs = [doc for doc in found if len(doc.text) >= MIN_DOC_CHARS]
    docs.sort(key=lambda doc: doc.title)
    titles = [doc.title for doc in docs]
    assert len(set(titles)) == len(titles), "corpus titles must be unique"
    return docs


def _write_jsonl(path: Path, docs: list[Document]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc.text}, ensure_ascii=False) + "\n")


def build_builtin_corpus(out_dir: str | Path, source: str = BUILTIN_DOCS) -> dict:
    """Write a source's train.jsonl, validation.jsonl and meta.json into `out_dir`; return the meta."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = collect_documents(source=source)
    splits = {
        "train": [d for d in docs if not is_validation(d.title)],
        "validation": [d for d in docs if is_validation(d.title)],
    }
    _write_jsonl(out_dir / TRAIN_FILE, splits["train"])
    _write_jsonl(out_dir / VALIDATION_FILE, splits["validation"])
    meta = {
        "name": corpus_name(source),
        "format_version": FORMAT_VERSION[source],
        "python": platform.python_version(),  # stdlib docs change between patch releases
        "splits": {
            name: {"documents": len(split), "characters": sum(len(d.text) for d in split)}
            for name, split in splits.items()
        },
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def ensure_builtin_corpus(force: bool = False, source: str = BUILTIN_DOCS) -> Path:
    """Build a source's corpus once into the cache (safe across processes); return its folder.

    `force=True` rebuilds it even if cached.
    """
    if source not in BUILTIN_SOURCES:
        raise ValueError(f"built-in corpus source {source!r}: allowed {', '.join(BUILTIN_SOURCES)}")

    def build(tmp: Path) -> None:
        meta = build_builtin_corpus(tmp, source)
        train, val = meta["splits"]["train"], meta["splits"]["validation"]
        logger.info(
            "built corpus %s: train %d docs / %.1f M chars, validation %d docs / %.2f M chars",
            meta["name"], train["documents"], train["characters"] / 1e6,
            val["documents"], val["characters"] / 1e6,
        )

    return build_once(cache_dir() / "corpus" / corpus_name(source), build, force)


def read_texts(jsonl_path: str | Path) -> Iterator[str]:
    """Yield the "text" field of each line of a corpus jsonl file."""
    with open(jsonl_path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]
