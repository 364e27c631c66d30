"""Where generated assets (corpus, tokenizer) live, and how to build them safely once.

Every torchrun rank calls the same `ensure_*` function at start-up. Instead of electing a
builder rank (which needs a process group), ranks race on a file lock: the first one builds,
the others wait and then find the finished asset. Assets are built in a temporary sibling
folder of the builder's own (named after its host and pid) and renamed into place, so a crash
never leaves a half-built asset that looks complete.

On a shared filesystem whose locks are node-local (BeeGFS by default, Lustre `localflock`,
NFS `local_lock`), one builder per node gets the lock: each builds in its own folder, the
first rename wins and the others discard theirs. A builder removes only the leftovers of
builders that are gone: of this host, whose pid is dead; of another host, untouched for
STALE_BUILD_SECONDS. It never removes a build in progress on another node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock, Timeout

from gamma_titan.errors import ConfigError

logger = logging.getLogger(__name__)

CACHE_ENV = "GAMMA_TITAN_CACHE"

# Temporary build folders are named ".<final name>.tmp-<host>-<pid>-<random>" next to the final folder.
_TMP_MARKER = ".tmp-"
#: A leftover build folder of another host counts as abandoned once untouched this long (a
#: host cannot ask whether a process on another one is alive; builds take minutes).
STALE_BUILD_SECONDS = 6 * 3600


def cache_dir() -> Path:
    """Root of our cache: `$GAMMA_TITAN_CACHE` if set, else `~/.cache/gamma-titan`."""
    override = os.environ.get(CACHE_ENV)
    root = Path(override) if override else Path.home() / ".cache" / "gamma-titan"
    return root.expanduser()


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the `with` body.

    `filelock` takes an `flock` on Unix: the kernel releases it if the holder dies, so a
    killed rank cannot leave the cache locked forever, and the lock file stays in place (a
    deleted one would let a late process lock a new inode while another holds the old one).
    Note: flock is per host; on a shared network filesystem it may not exclude other nodes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        # Someone else is building; say so, since the wait can take a while.
        logger.info("waiting for lock %s (another process is building)", path)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def atomic_dir(final_path: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder; on success rename it to `final_path`.

    The temporary folder is a sibling of `final_path` so the rename stays on one filesystem
    (and is therefore atomic). On error the temporary folder is removed. If `final_path`
    already exists when we finish, `replace=True` swaps ours in; otherwise theirs wins and
    ours is discarded (both are builds of the same asset).
    """
    final_path = Path(final_path)
    final_path.parent.mkdir(parents=True, exist_ok=True)
    owner = f"{_host()}-{os.getpid()}-"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final_path.name}{_TMP_MARKER}{owner}", dir=final_path.parent))
    try:
        # mkdtemp makes the folder private (0700); the finished asset should be readable
        # like any other cache entry.
        tmp.chmod(0o755)
        yield tmp
        _publish(tmp, final_path, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json_atomic(path: str | os.PathLike, data, default=None) -> None:
    """Write `data` as JSON to `path` through a temporary sibling and a rename, so a reader
    (or a crash) never sees half a file."""
    import json

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=default) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _publish(tmp: Path, final_path: Path, replace: bool) -> None:
    """Rename the finished `tmp` folder to `final_path` (see `atomic_dir`)."""
    if replace and final_path.is_dir():
        # A folder cannot be renamed over a non-empty one: move the old one aside first.
        # Its holding folder carries the temp prefix, so a crash here leaves only a stale
        # build that the next `build_once` removes.
        old = Path(tempfile.mkdtemp(prefix=f"{tmp.name}-old-", dir=final_path.parent))
        os.rename(final_path, old / final_path.name)
        os.rename(tmp, final_path)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.rename(tmp, final_path)
    except OSError:
        if not final_path.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # someone else's build got there first


def build_once(
    final_path: str | os.PathLike, build: Callable[[Path], None], force: bool = False
) -> Path:
    """Return `final_path`, first running `build(tmp_dir)` if it does not exist yet.

    Safe to call from many processes at once: only one of them runs `build`.
    `force=True` rebuilds and replaces an existing asset.
    """
    final_path = Path(final_path)
    if final_path.is_dir() and not force:  # fast path: a finished asset never changes
        return final_path
    with file_lock(final_path.parent / f"{final_path.name}.lock"):
        if final_path.is_dir() and not force:  # built by whoever held the lock before us
            return final_path
        _remove_stale_builds(final_path)
        with atomic_dir(final_path, replace=force) as tmp:
            build(tmp)
    return final_path


def _host() -> str:
    """Where a process id means this process: the host name, and the kernel's boot id and
    this process's pid namespace (containers on several nodes often share one host name,
    and containers on one node share the boot id; a pid checked in the wrong place is
    "gone", and its build in progress was deleted)."""
    import hashlib

    where = []
    for path, read in (("/proc/sys/kernel/random/boot_id", lambda p: Path(p).read_text().strip()),
                       ("/proc/self/ns/pid", os.readlink)):
        try:
            where.append(read(path))
        except OSError:  # not Linux: the host name alone
            pass
    tag = f"_{hashlib.sha1('|'.join(where).encode()).hexdigest()[:8]}" if where else ""
    return socket.gethostname().replace("-", "_") + tag


def _remove_stale_builds(final_path: Path) -> None:
    """Delete temporary folders left by builders that are gone (we hold the lock, which on a
    node-local lock does not exclude another node's builder: its folder is left alone)."""
    prefix = f".{final_path.name}{_TMP_MARKER}"
    for leftover in final_path.parent.glob(prefix + "*"):
        if _abandoned(leftover.name[len(prefix):], leftover):
            shutil.rmtree(leftover, ignore_errors=True)


def _abandoned(owner: str, folder: Path) -> bool:
    """`owner` is "<host>-<pid>-<random>" (see atomic_dir); a folder of an older form, or of
    another host, is abandoned once untouched for STALE_BUILD_SECONDS."""
    host, _, rest = owner.partition("-")
    pid = rest.partition("-")[0]
    if host == _host() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    try:
        return time.time() - folder.stat().st_mtime > STALE_BUILD_SECONDS
    except OSError:
        return False


# --------------------------------------------------------------------------- gamma-titan cache

#: What each top-level folder of the cache holds (`gamma-titan cache`).
CACHE_KINDS = {
    "corpus": "the built-in corpus's text",
    "tokenizer": "the built-in tokenizers, one per vocabulary size",
    "shards": "the built-in corpus pretokenized, one folder per (source, tokenizer)",
    "hf-datasets": "Arrow copies of local text that versions before 2026-12 converted; nothing reads them now",
}


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cache_entries() -> list[tuple[str, int]]:
    """(entry, bytes) of every asset in the cache: `kind/name` for the built assets, the
    whole folder for the leftover Arrow copies; lock files (empty) left out."""
    root, out = cache_dir(), []
    for kind in CACHE_KINDS:
        folder = root / kind
        if kind == "hf-datasets":
            if folder.is_dir():
                out.append((kind, folder_bytes(folder)))
            continue
        for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
            if entry.is_dir():
                out.append((f"{kind}/{entry.name}", folder_bytes(entry)))
    return out


def clear_cache(names: list[str]) -> list[tuple[str, int]]:
    """Remove the named entries (`kind/name`, or a kind: all of its entries; none named: all),
    each under its build lock, so a process building it finishes first. An unknown name is
    refused in one line, before anything is removed."""
    entries = dict(cache_entries())
    chosen = list(entries) if not names else []
    for name in names:
        match = [e for e in entries if e == name.rstrip("/") or e.startswith(name.rstrip("/") + "/")]
        if not match:
            raise ConfigError(f"cache clear {name}: no such entry in {cache_dir()}; "
                              f"`gamma-titan cache` lists them ({', '.join(CACHE_KINDS)})")
        chosen += [e for e in match if e not in chosen]
    root = cache_dir()
    for entry in chosen:
        path = root / entry
        with file_lock(path.parent / f"{path.name}.lock") if "/" in entry else contextlib.nullcontext():
            shutil.rmtree(path, ignore_errors=True)
    return [(entry, entries[entry]) for entry in chosen]
