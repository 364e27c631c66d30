"""The cache folder, the cross-process lock and atomic builds."""

import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gamma_titan.data import cache
from gamma_titan.data.cache import atomic_dir, build_once, cache_dir, file_lock


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GAMMA_TITAN_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("GAMMA_TITAN_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "gamma-titan"


def test_atomic_dir_publishes_only_on_success(tmp_path):
    final = tmp_path / "asset"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "half.txt").write_text("x")
            raise RuntimeError("build failed")
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []  # the temporary folder is gone too

    with atomic_dir(final) as tmp:
        assert not final.exists()  # nothing visible while building
        (tmp / "done.txt").write_text("x")
    assert (final / "done.txt").read_text() == "x"


def test_atomic_dir_keeps_existing_result(tmp_path):
    final = tmp_path / "asset"
    with atomic_dir(final) as tmp:
        (tmp / "first").touch()
        # Someone else publishes while we build: theirs is kept, ours discarded.
        final.mkdir()
        (final / "other").touch()
    assert sorted(p.name for p in final.iterdir()) == ["other"]
    assert [p.name for p in tmp_path.iterdir()] == ["asset"]


def dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_build_once_removes_the_builds_of_builders_that_are_gone_and_no_other(tmp_path):
    """A leftover of this host whose pid is dead goes; another node's build in progress (its
    lock node-local, so it builds while we hold ours) stays until it is STALE_BUILD_SECONDS
    old."""
    marker = f".asset{cache._TMP_MARKER}"
    dead = tmp_path / f"{marker}{cache._host()}-{dead_pid()}-x1"
    alive = tmp_path / f"{marker}{cache._host()}-{os.getpid()}-x2"
    other_node = tmp_path / f"{marker}node_b-123-x3"
    abandoned = tmp_path / f"{marker}node_c-456-x4"
    # a builder with this very host name in another pid namespace (a container beside this one,
    # or on another node), building as a pid that is not alive here: kept
    twin_host = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                                "import gamma_titan.data.cache as c; print(c._host())"],
                               capture_output=True, text=True).stdout.strip()
    if not twin_host:
        pytest.skip("unshare --pid needs root")
    assert twin_host.startswith(socket.gethostname().replace("-", "_")) and twin_host != cache._host()
    twin = tmp_path / f"{marker}{twin_host}-{dead_pid()}-x5"
    for folder in (dead, alive, other_node, abandoned, twin):
        folder.mkdir()
    old = time.time() - cache.STALE_BUILD_SECONDS - 60
    os.utime(abandoned, (old, old))
    calls = []
    path = build_once(tmp_path / "asset", lambda tmp: calls.append((tmp / "f").touch()))
    assert build_once(tmp_path / "asset", lambda tmp: calls.append(1)) == path
    assert len(calls) == 1 and (path / "f").exists()
    assert not dead.exists() and not abandoned.exists() and alive.exists() and other_node.exists() and twin.exists()


def _build_without_exclusion(final, log_path, second: bool):
    """A builder on a node whose lock does not see the other node's (node-local flock); the
    second starts while the first is building."""
    import contextlib

    cache.file_lock = lambda path: contextlib.nullcontext()

    def build(tmp):
        with open(log_path, "a") as log:
            log.write(f"start {os.getpid()}\n")
        for i in range(20):
            (tmp / f"part{i}").write_text(str(os.getpid()))
            time.sleep(0.02)
        assert len(list(tmp.iterdir())) == 20, "a folder being built was removed under its builder"

    while second and not (log_path.exists() and log_path.read_text()):
        time.sleep(0.01)
    build_once(final, build)


def test_two_nodes_with_node_local_locks_both_build_and_one_build_is_published(tmp_path):
    ctx = multiprocessing.get_context("fork")
    log = tmp_path / "builds.log"
    procs = [ctx.Process(target=_build_without_exclusion, args=(tmp_path / "asset", log, i == 1)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(log.read_text().splitlines()) == 2  # both built: neither lock excluded the other
    builders = {(tmp_path / "asset" / f"part{i}").read_text() for i in range(20)}
    assert len(builders) == 1  # one whole build, not a mix
    assert [p.name for p in tmp_path.iterdir() if p.name != "builds.log"] == ["asset"]  # the other discarded


def test_build_once_force_replaces(tmp_path):
    final = tmp_path / "asset"
    build_once(final, lambda tmp: (tmp / "v1").touch())
    build_once(final, lambda tmp: (tmp / "v2").touch(), force=True)
    assert [p.name for p in final.iterdir()] == ["v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["asset", "asset.lock"]


# ---- two processes racing, like torchrun ranks ---------------------------------------------
# "fork" rather than "spawn": a spawned child re-imports gamma_titan (torch, torchtitan), which
# costs seconds per process; forked children are separate processes with their own lock file
# descriptors all the same, which is what the lock cares about.


def _hold_lock(lock_path, log_path, barrier):
    barrier.wait()
    with file_lock(lock_path):
        with open(log_path, "a") as log:
            log.write(f"enter {os.getpid()}\n")
        time.sleep(0.3)
        with open(log_path, "a") as log:
            log.write(f"exit {os.getpid()}\n")


def test_file_lock_excludes_other_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    log = tmp_path / "log"
    procs = [
        ctx.Process(target=_hold_lock, args=(tmp_path / "x.lock", log, barrier)) for _ in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    events = [line.split()[0] for line in log.read_text().splitlines()]
    assert events == ["enter", "exit", "enter", "exit"]  # never interleaved


def _ensure_in_child(cache_root, vocab_size, log_path, barrier, results):
    """Call ensure_builtin_tokenizer (which needs the corpus) and record every real build."""
    os.environ["GAMMA_TITAN_CACHE"] = str(cache_root)
    from gamma_titan.data import builtin_corpus, tokenizer

    def counted(name, real):
        def wrapper(*args, **kwargs):
            with open(log_path, "a") as log:
                log.write(f"{name}\n")
            return real(*args, **kwargs)

        return wrapper

    builtin_corpus.build_builtin_corpus = counted("corpus", builtin_corpus.build_builtin_corpus)
    tokenizer.train_bpe_tokenizer = counted("tokenizer", tokenizer.train_bpe_tokenizer)
    barrier.wait()  # start both builds at the same moment
    path = tokenizer.ensure_builtin_tokenizer(vocab_size)
    results.put((str(path), (path / "tokenizer.json").read_bytes()))


def test_concurrent_ensure_builds_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    log = tmp_path / "builds.log"
    procs = [
        ctx.Process(target=_ensure_in_child, args=(tmp_path / "cache", 300, log, barrier, results))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0

    assert outcomes[0] == outcomes[1]  # same folder, identical bytes
    assert sorted(log.read_text().split()) == ["corpus", "tokenizer"]  # each built once
    leftovers = [p.name for p in (tmp_path / "cache").rglob(".*tmp-*")]
    assert leftovers == []


def test_the_cache_command_lists_and_clears_what_the_cache_holds(tmp_path, monkeypatch, capsys):
    """`gamma-titan cache` lists every asset with its size; `cache clear` removes the named
    ones (an entry, or a kind), under their build locks; an unknown name removes nothing."""
    from gamma_titan.cli import main as cli_main

    monkeypatch.setenv("GAMMA_TITAN_CACHE", str(tmp_path))
    sizes = {"shards/docs-abc": 3000, "shards/code-abc": 5000, "tokenizer/bpe512": 700, "hf-datasets": 2048}
    for entry, size in sizes.items():
        (tmp_path / entry).mkdir(parents=True)
        (tmp_path / entry / "data.bin").write_bytes(b"x" * size)
    (tmp_path / "shards" / "docs-abc.lock").touch()

    def run(*argv) -> tuple[int, str]:
        with pytest.raises(SystemExit) as done:
            cli_main(["cache", *argv])
        out = capsys.readouterr()
        return done.value.code, out.out + out.err

    code, listing = run()
    assert code == 0 and f"{sum(sizes.values()) / 2**20:.1f} MiB" in listing
    assert all(entry in listing for entry in sizes) and "docs-abc.lock" not in listing
    code, said = run("clear", "nothing-like-it")
    assert code == 2 and said.startswith("error: cache clear nothing-like-it: no such entry") and said.count("\n") == 1
    assert all((tmp_path / entry).is_dir() for entry in sizes)
    code, said = run("clear", "shards", "hf-datasets")
    assert code == 0 and "removed 3 entries" in said
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_dir()) == ["bpe512", "shards", "tokenizer"]
    assert (tmp_path / "shards" / "docs-abc.lock").exists()  # a lock stays (another process may hold it)
    code, said = run("clear")
    assert code == 0 and not (tmp_path / "tokenizer" / "bpe512").exists()
