"""The data path: tokenizer training from a source, pretokenized shards, the memmap loader,
mixtures, and every bad input's one-line error."""

import collections
import itertools
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from torchtitan.config.job_config import DataLoader

from gamma_titan.cli import main as cli_main
from gamma_titan.data.builtin_corpus import read_texts
from gamma_titan.data.loader import shard_dataloader
from gamma_titan.data.pretokenize import is_validation, pretokenize
from gamma_titan.data.rank_batches import PackedSequences
from gamma_titan.data.sampling import Mixture
from gamma_titan.data.shard_sources import open_samples
from gamma_titan.data.shards import TokenShards, tokenizer_info
from gamma_titan.errors import ConfigError

VOCAB = 400
VAL_FRACTION = 0.15
SEQ = 64
EDGE_CASES = ["", "  spaces  ", "Ünïcödé 日本語 🙂\n\ttabs\r\n", "x"]


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def _cli(*argv):
    with pytest.raises(SystemExit) as exit_:
        cli_main(list(argv))
    return exit_.value.code


@pytest.fixture(scope="module")
def work(tmp_path_factory, builtin_corpus):
    """A 150-document jsonl, a tokenizer trained on it through the CLI, and its shards
    written by 2 processes in units of 20 documents with 15% held out."""
    root = tmp_path_factory.mktemp("data")
    texts = list(read_texts(builtin_corpus / "train.jsonl"))[:146] + EDGE_CASES
    corpus = _jsonl(root / "corpus.jsonl", texts)
    assert _cli("tokenizer", "train", "--input", str(corpus), "--vocab-size", str(VOCAB),
                "--out", str(root / "tok")) == 0
    assert _cli("pretokenize", "--input", str(corpus), "--tokenizer", str(root / "tok"),
                "--out", str(root / "shards"), "--num-proc", "2", "--val-fraction", str(VAL_FRACTION),
                "--docs-per-shard", "20", "--quiet") == 0
    return root, texts


def _job(tokenizer, path, **data):
    from gamma_titan.config import load_job_config

    config = load_job_config(["--job.config_file", "configs/dense/debug.toml"])
    config.model.hf_assets_path = str(tokenizer)
    config.training.dataset, config.training.dataset_path = "memmap", str(path)
    config.validation.dataset, config.validation.dataset_path = "memmap", None
    for key, value in data.items():
        setattr(config.gamma.data, key, value)
    return config


# ---- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_trained_from_a_source_loads_in_torchtitan_and_transformers(work):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    transformers = pytest.importorskip("transformers")

    root, texts = work
    titan = HuggingFaceTokenizer(str(root / "tok"))
    hf = transformers.AutoTokenizer.from_pretrained(str(root / "tok"))
    assert titan.get_vocab_size() == len(hf) == VOCAB
    assert (titan.bos_id, titan.eos_id) == (hf.bos_token_id, hf.eos_token_id) == (0, 1)
    for text in texts[:5] + EDGE_CASES:
        ids = titan.encode(text, add_bos=True, add_eos=True)
        assert ids == [0] + hf.encode(text) + [1]
        assert hf.decode(ids, skip_special_tokens=True) == text
    assert _cli("tokenizer", "train", "--input", str(root / "corpus.jsonl"), "--out", str(root / "tok")) == 2


# ---- pretokenize ----------------------------------------------------------------------------


def test_round_trip_gives_back_the_documents(work):
    root, texts = work
    tok = Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    meta = json.loads((root / "shards" / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["tokenizer"]["vocab_size"] == VOCAB
    assert len(meta["units"]["input"]) == 8  # 150 documents in units of 20
    expected = {"train": [t for t in texts if not is_validation(t, VAL_FRACTION)],
                "validation": [t for t in texts if is_validation(t, VAL_FRACTION)]}
    assert 10 <= len(expected["validation"]) <= 40
    for split, want in expected.items():
        shards = TokenShards(root / "shards", split)
        docs = shards.documents()
        assert [tok.decode(d[1:-1].tolist(), skip_special_tokens=False) for d in docs] == want
        assert all(d[0] == 0 and d[-1] == 1 for d in docs)
        assert len(shards) == meta["splits"][split]["tokens"] == sum(map(len, docs))
        assert meta["splits"][split]["docs"] == len(want)


def test_large_vocabularies_are_stored_as_uint32(work, tmp_path, monkeypatch):
    from gamma_titan.data import pretokenize as pretokenize_module
    from gamma_titan.data.shards import TokenizerInfo, token_dtype

    assert (token_dtype(2**16), token_dtype(2**16 + 1)) == (np.uint16, np.uint32)
    root, texts = work
    real = tokenizer_info(root / "tok")
    wide = TokenizerInfo(real.sha256, 70_000, real.bos_id, real.eos_id)
    monkeypatch.setattr(pretokenize_module, "tokenizer_info", lambda folder: wide)
    pretokenize(str(root / "corpus.jsonl"), root / "tok", tmp_path / "wide", docs_per_shard=64, progress=False)
    shards = TokenShards(tmp_path / "wide", "train")
    assert shards.dtype == np.uint32 and shards.files[0].stat().st_size == 4 * len(shards._arrays[0])
    tok = Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    assert [tok.decode(d[1:-1].tolist()) for d in shards.documents()] == texts


def test_a_unit_encoded_in_batches_writes_the_same_shards(work, tmp_path, monkeypatch):
    """Workers encode a unit ENCODE_BATCH_DOCS documents at a time (a whole unit's Encodings
    held 3 GB a worker): batches of 7 across units of 64 (a short last batch in each) write
    byte for byte the shards of one batch a unit, and give the documents back."""
    from gamma_titan.data import pretokenize as pretokenize_module

    root, texts = work
    outs = {}
    for batch in (7, 64):
        monkeypatch.setattr(pretokenize_module, "ENCODE_BATCH_DOCS", batch)
        outs[batch] = tmp_path / f"batch{batch}"
        pretokenize(str(root / "corpus.jsonl"), root / "tok", outs[batch], docs_per_shard=64,
                    val_fraction=VAL_FRACTION, progress=False)
    metas = [json.loads((out / "meta.json").read_text()) for out in outs.values()]
    assert metas[0]["splits"] == metas[1]["splits"] and len(metas[0]["splits"]["train"]["shards"]) == 3
    tok = Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    assert [tok.decode(d[1:-1].tolist()) for d in TokenShards(outs[7], "train").documents()] == \
        [t for t in texts if not is_validation(t, VAL_FRACTION)]


def test_pretokenize_resumes_and_is_idempotent(work, tmp_path):
    root, _ = work
    out = tmp_path / "shards"
    shutil.copytree(root / "shards", out)
    meta = (out / "meta.json").read_text()
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*.bin")}

    again = pretokenize(str(root / "corpus.jsonl"), root / "tok", out, val_fraction=VAL_FRACTION,
                        docs_per_shard=20, progress=False)
    assert (again.units_encoded, again.units_skipped) == (0, 8)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.bin")} == mtimes

    # A run killed after unit 3 was written but before it was recorded, and unit 5 truncated.
    (out / "meta.json").unlink()
    (out / ".progress" / "00003.json").unlink()
    with open(out / "train" / "00005.bin", "r+b") as f:
        f.truncate(10)
    resumed = pretokenize(str(root / "corpus.jsonl"), root / "tok", out, val_fraction=VAL_FRACTION,
                          docs_per_shard=20, num_proc=1, progress=False)
    assert (resumed.units_encoded, resumed.units_skipped) == (2, 6)
    assert (out / "meta.json").read_text() == meta  # the same as 2 processes wrote in one go
    assert (out / "train" / "00000.bin").stat().st_mtime_ns == mtimes[out / "train" / "00000.bin"]


def test_pretokenize_bad_input(work, tmp_path):
    root, _ = work
    corpus, tok = str(root / "corpus.jsonl"), root / "tok"
    with pytest.raises(ConfigError, match="--out: .* other settings \\(docs_per_shard differ\\)"):
        pretokenize(corpus, tok, root / "shards", val_fraction=VAL_FRACTION, docs_per_shard=7, progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--out: .* exists and is not an empty folder"):
        pretokenize(corpus, tok, tmp_path / "full", progress=False)
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="--input: .*empty.jsonl. is empty \\(no documents\\)"):
        pretokenize(str(_jsonl(tmp_path / "empty.jsonl", [])), tok, tmp_path / "e", progress=False)
    with pytest.raises(ConfigError, match="--val-fraction 1.5: must be in"):
        pretokenize(corpus, tok, tmp_path / "v", val_fraction=1.5)
    with pytest.raises(ConfigError, match="--input: .*missing.jsonl' does not exist"):
        pretokenize(str(tmp_path / "missing.jsonl"), tok, tmp_path / "m")
    assert not (tmp_path / "v").exists() and not (tmp_path / "m").exists()


# ---- the loader -----------------------------------------------------------------------------


def _windows(samples, rank, world, batch, n_batches=None, state=None, on_exhausted="stop"):
    ds = PackedSequences(samples, rank, world, batch, on_exhausted=on_exhausted)
    loader = shard_dataloader(ds, rank, world, DataLoader())
    if state is not None:
        loader.load_state_dict(state)
    out = [(x["input"], y) for x, y in itertools.islice(iter(loader), n_batches)]
    return out, loader.state_dict()


def test_two_ranks_see_disjoint_halves_of_the_epoch(work):
    root, _ = work
    samples = open_samples(_job(root / "tok", root / "shards"), "training", SEQ)
    batch = 3
    per_rank = [_windows(samples, r, 2, batch)[0] for r in range(2)]
    seen = collections.Counter(tuple(x.tolist()) for rank in per_rank for xs, _ in rank for x in xs)
    n = samples.epoch_samples
    every = collections.Counter(tuple(samples.tokens.read(i * SEQ, i * SEQ + SEQ).tolist()) for i in range(n))
    assert sum(seen.values()) == n - n % (2 * batch)  # the last partial global batch is dropped
    assert not seen - every and len(every - seen) <= n % (2 * batch)
    first_rank = collections.Counter(tuple(x.tolist()) for xs, _ in per_rank[0] for x in xs)
    assert not first_rank & collections.Counter(tuple(x.tolist()) for xs, _ in per_rank[1] for x in xs)
    for xs, ys in per_rank[0]:
        assert torch.equal(xs[:, 1:], ys[:, :-1]) and xs.dtype == torch.int64


def test_resume_gives_the_same_batches_bitwise(work, caplog):
    root, _ = work
    samples = open_samples(_job(root / "tok", root / "shards"), "training", SEQ)
    steps = samples.epoch_samples // 8 + 10  # runs into the second, reshuffled epoch
    whole, _ = _windows(samples, 1, 2, 4, steps, on_exhausted="wrap")
    first, state = _windows(samples, 1, 2, 4, 7, on_exhausted="wrap")
    fresh = open_samples(_job(root / "tok", root / "shards"), "training", SEQ)
    rest, _ = _windows(fresh, 1, 2, 4, steps - 7, state=state, on_exhausted="wrap")
    assert len(whole) == len(first + rest) == steps
    for (x, y), (x2, y2) in zip(whole, first + rest):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert "starting epoch 2" in caplog.text


def test_validation_reads_the_same_batches_every_pass(work):
    from gamma_titan.data.loader import build_validation_dataloader

    root, _ = work
    job = _job(root / "tok", root / "shards")
    job.validation.local_batch_size, job.validation.seq_len = 2, 32
    held_out = TokenShards(root / "shards", "validation")
    n = (len(held_out) - 1) // 32
    for steps, sequences in ((20, 40), (-1, n)):  # validation.steps x local_batch_size in all; -1: the split
        job.validation.steps = steps
        loader = build_validation_dataloader(1, 0, None, job, infinite=steps != -1)
        passes = [[(x["input"], labels) for x, labels in loader] for _ in range(2)]
        assert len(passes[0]) == math.ceil(sequences / 2) > 0
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(*passes))
        assert passes[0][0][0][0].tolist() == held_out.read(0, 32).tolist()  # in order, from the start
        padded = sum(int((labels == -100).all(dim=1).sum()) for _, labels in passes[0])
        assert padded == 2 * len(passes[0]) - sequences  # an odd count pads the last batch's second row


@pytest.fixture(scope="module")
def mixture_root(work):
    """Three shard folders whose documents repeat one word each; no two words share a letter."""
    root, _ = work
    for word in WORDS:
        docs = [" ".join([word] * (20 + i)) for i in range(30)]
        pretokenize(str(_jsonl(root / f"{word}.jsonl", docs)), root / "tok", root / "mix" / word,
                    val_fraction=0.2, progress=False)
    return root / "mix"


WORDS = ("mum", "dad", "kik")


def _source_of(window, tok):
    letters = set(tok.decode(window.tolist(), skip_special_tokens=True)) - {" "}
    (word,) = [w for w in WORDS if letters <= set(w)]
    return word


def test_mixture_realises_its_weights_over_10k_sequences(work, mixture_root):
    root, _ = work
    weights = {"mum": 0.5, "dad": 0.3, "kik": 0.2}
    samples = open_samples(_job(root / "tok", mixture_root, mixture=weights), "training", 16)
    assert isinstance(samples, Mixture)
    tok = Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    n = 10_000
    counts = collections.Counter(_source_of(samples.get(g), tok) for g in range(n))
    for name, weight in weights.items():
        assert abs(counts[name] / n - weight) < 0.02
        assert abs(counts[name] - weight * n) <= 2  # the table spreads draws evenly
    # The same proportions through a mixture file, relative to the file's folder.
    (mixture_root / "mix.toml").write_text('mixture = { mum = 1, dad = 1 }\n')
    from_file = open_samples(_job(root / "tok", mixture_root / "mix.toml"), "training", 16)
    counts = collections.Counter(_source_of(from_file.get(g), tok) for g in range(1000))
    assert counts == {"mum": 500, "dad": 500}


def test_on_exhausted_stop_ends_every_rank_at_the_same_batch(work, caplog):
    root, _ = work
    samples = open_samples(_job(root / "tok", root / "shards"), "training", SEQ)
    lengths = [len(_windows(samples, r, 2, 5)[0]) for r in range(2)]
    assert lengths[0] == lengths[1] == samples.epoch_samples // 10
    assert "end of data" in caplog.text


# ---- bad input --------------------------------------------------------------------------------


def _preflight_error(config) -> str:
    from gamma_titan.training.preflight import preflight

    with pytest.raises(ConfigError) as err:
        preflight(config, world_size=1)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_bad_data_gives_one_line_errors(work, mixture_root, tmp_path, builtin_tokenizer, builtin_corpus):
    root, _ = work
    tok, shards = root / "tok", root / "shards"
    assert "the tokenizer has 4096 tokens but the shards" in _preflight_error(_job(builtin_tokenizer, shards))
    other = tmp_path / "tok2"  # same size, trained on other text: another hash
    assert _cli("tokenizer", "train", "--input", str(root / "mum.jsonl"), "--vocab-size", str(VOCAB),
                "--out", str(other)) == 2  # too little text for 400 tokens
    assert _cli("tokenizer", "train", "--input", str(builtin_corpus / "validation.jsonl"),
                "--vocab-size", str(VOCAB), "--out", str(other)) == 0
    assert tokenizer_info(other).vocab_size == VOCAB
    assert "is not the one the shards in" in _preflight_error(_job(other, shards))

    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    with open(broken / "train" / "00002.bin", "r+b") as f:
        f.truncate(100)
    assert "00002.bin has 100 bytes, expected" in _preflight_error(_job(tok, broken))
    shutil.copy(shards / "train" / "00002.bin", broken / "train" / "00002.bin")
    np.save(broken / "train" / "00002.idx.npy", np.array([0, 5, 3]))
    assert f"00002.bin and its index {broken / 'train' / '00002.idx.npy'} do not agree" in _preflight_error(_job(tok, broken))
    shutil.copy(shards / "train" / "00002.idx.npy", broken / "train" / "00002.idx.npy")
    with open(broken / "train" / "00002.bin", "r+b") as f:  # garbage in the middle: caught on read
        f.seek(200)
        f.write(b"\xff" * 64)
    corrupt = TokenShards(broken, "train")
    start = int(corrupt._starts[2])
    with pytest.raises(RuntimeError, match="00002.bin holds token id 65535 >= vocab size"):
        corrupt.read(start, start + 300)

    assert "training.dataset_path: " in _preflight_error(_job(tok, tmp_path / "nowhere"))
    assert "is not a shard folder (no meta.json)" in _preflight_error(_job(tok, tmp_path))
    message = _preflight_error(_job(tok, mixture_root, mixture={"mum": 0.5, "delta": 0.5}))
    assert message.startswith("gamma.data.mixture.delta: folder ") and "does not exist" in message
    assert "sum to 0" in _preflight_error(_job(tok, mixture_root, mixture={"mum": 0, "dad": 0}))
    assert "must be a number >= 0" in _preflight_error(_job(tok, mixture_root, mixture={"mum": -1.0}))
    assert "single shard folder" in _preflight_error(_job(tok, shards, mixture={"mum": 1.0}))
    (tmp_path / "bad.toml").write_text("mixture = {")
    assert "does not parse" in _preflight_error(_job(tok, tmp_path / "bad.toml"))
    tiny = tmp_path / "tiny"
    pretokenize(str(_jsonl(tmp_path / "tiny.jsonl", ["a b"])), tok, tiny, progress=False)
    assert "not enough for one sequence of seq_len" in _preflight_error(_job(tok, tiny))
    job = _job(tok, shards, on_exhausted="stop")
    job.training.local_batch_size = 10_000
    assert "fewer than one global batch" in _preflight_error(job)
    job = _job(tok, shards)
    job.training.dataloader.num_workers = 2
    with pytest.raises(ConfigError, match="training.dataloader.num_workers = 2: must be 0"):
        from gamma_titan.data.loader import build_dataloader
        build_dataloader(1, 0, None, job)


def test_bad_data_toml_values_fail_at_load(tmp_path):
    from gamma_titan.config import load_job_config

    def error(config, *overrides):
        with pytest.raises(ConfigError) as err:
            load_job_config(["--job.config_file", str(config), *overrides])
        return str(err.value)

    debug = "configs/dense/debug.toml"
    assert "gamma.data.on_exhausted = 'loop': allowed wrap, stop" in error(debug, "--gamma.data.on_exhausted", "loop")
    base = open(debug).read()
    for table, message in [('mixture = { web = "x" }', "gamma.data.mixture.web = 'x': a weight must be a number >= 0"),
                           ('on_exhausted = "loop"', "gamma.data.on_exhausted = 'loop': allowed wrap, stop"),
                           ("shufle = true", "unknown key 'gamma.data.shufle' in [gamma.data]")]:
        toml = tmp_path / "c.toml"
        toml.write_text(f"{base}\n[gamma.data]\n{table}\n")
        assert message in error(toml)


def test_builtin_datasets_read_the_cached_shards(builtin_tokenizer):
    from gamma_titan.config import load_job_config

    config = load_job_config(["--job.config_file", "configs/dense/debug.toml"])
    train = open_samples(config, "training", 256)
    val = open_samples(config, "validation", 256)
    assert train.tokens.folder == val.tokens.folder and os.path.isdir(train.tokens.folder)
    assert (train.tokens.split, val.tokens.split) == ("train", "validation") and train.shuffle and not val.shuffle
    config.training.dataset_path = "/somewhere"
    assert "must be unset for dataset 'builtin'" in _preflight_error(config)


@pytest.mark.multiprocess
def test_a_run_that_runs_out_of_data_stops_cleanly_with_its_last_step_saved(work, tmp_path):
    """gamma.data.on_exhausted = "stop" end to end: a real trainer on shards of three short
    documents, asked for 1000 steps, trains exactly the global batches the shards hold
    (their windows of seq_len + 1 tokens, over the batch size), exits 0, and has a complete
    checkpoint of the last step (which TorchTitan alone would not save) next to the
    interval's."""
    from helpers import QUIET, read_metrics, run_trainer

    from gamma_titan.training.checkpoint_folders import checkpoint_steps

    root, texts = work
    shards = tmp_path / "shards"
    few = [text[:1500] for text in texts[:3]]
    pretokenize(str(_jsonl(tmp_path / "few.jsonl", few)), root / "tok", shards, progress=False)
    tokens = json.loads((shards / "meta.json").read_text())["splits"]["train"]["tokens"]
    batch = 4
    steps = (tokens - 1) // SEQ // batch  # whole windows of SEQ + 1 tokens (shifted labels), whole batches
    assert 3 <= steps <= 12, (tokens, steps)
    dump = tmp_path / "run"
    proc = run_trainer(dump, *QUIET, "--model.flavor", "tiny-64", "--model.hf_assets_path", str(root / "tok"),
                       "--training.dataset", "memmap", "--training.dataset_path", str(shards),
                       "--training.seq_len", str(SEQ), "--training.local_batch_size", str(batch),
                       "--training.steps", "1000", "--gamma.data.on_exhausted", "stop",
                       "--gamma.diagnostics.enable", "false", "--checkpoint.enable", "true",
                       "--checkpoint.interval", str(steps - 1), "--checkpoint.keep_latest_k", "0")
    assert "end of data" in proc.stdout + proc.stderr
    assert [r["step"] for r in read_metrics(dump)] == list(range(1, steps + 1))
    assert checkpoint_steps(dump / "checkpoint") == ([steps - 1, steps], [])  # (complete, incomplete)


@pytest.mark.parametrize("step", [11, 1])
def test_trainer_saves_no_step_twice_and_no_step_0_when_data_runs_out(monkeypatch, step):
    """The branches the run above cannot reach: GammaTrainer saves nothing when the
    checkpoint interval (10 here) has saved the last finished step already, or when no step
    finished (a run that starts without data is refused before launch)."""
    from types import SimpleNamespace

    from torchtitan.components.dataloader import DataloaderExhaustedError

    from gamma_titan.training.trainer import GammaTrainer

    def exhausted(self, data_iterator):
        raise DataloaderExhaustedError()

    monkeypatch.setattr(GammaTrainer, "_train_step", exhausted)
    trainer = GammaTrainer.__new__(GammaTrainer)
    calls = []
    trainer.step = step
    trainer.job_config = SimpleNamespace(checkpoint=SimpleNamespace(interval=10))
    trainer.checkpointer = SimpleNamespace(save=lambda s, last_step: calls.append((s, last_step)))
    with pytest.raises(DataloaderExhaustedError):
        trainer.train_step(iter([]))
    assert calls == []
