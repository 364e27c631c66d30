"""`gamma-titan report tokens CKPT_SMALL CKPT_STD`: token-level loss analysis (paper §2.5, Fig. 4a–c).

Both models score the same held-out tokens. For each token y_t with context, model m gives
the probability p_m = p_m(y_t | y_<t) and the loss ℓ_m = −log p_m. Then:

- gain_t = ℓ_std − ℓ_small: how many nats the small-init model saves on this token;
- Δ^sym p_t = (p_small − p_std) / (p_small + p_std) ∈ [−1, 1], the symmetric probability
  difference: 0 when both models agree, +1 when only the small-init model gives the token
  any probability, −1 the other way; swapping the models flips its sign, and because it is
  relative, rare and frequent tokens count alike (the paper plots its distribution, 4a);
- difficulty_t = (ℓ_small + ℓ_std) / 2; tokens sorted by it and split into ten bins of equal
  size (± 1), with the mean gain per bin (4b);
- an HTML page colouring a text by per-token gain (4c): green where the small-init model is
  better, red where it is worse;
- the paired spread: the mean gain of each scored sequence (window of seq_len tokens), their
  standard deviation s and the mean gain's standard error s / √n over the n sequences. Both
  models score the same sequences, so s is the spread of a difference, far below either
  model's own per-sequence spread: it is what a validation set must be sized against
  (a loss delta Δ is resolved when s / √n ≪ Δ).

Outputs (OUT): tokens.json (summary, histogram, bins), delta_sym_p.png,
gain_by_difficulty.png, tokens.html, summary.md.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gamma_titan.errors import ConfigError
from gamma_titan.file_reads import load_tokenizer, read_toml
from gamma_titan.files import TOKENIZER_FILE

HIST_BINS = 40
DIFFICULTY_BINS = 10
HTML_TOKENS = 400


# --- models and data -----------------------------------------------------------------------


def load_model(checkpoint: str | Path, key: str):
    """(model in eval mode on the CPU, its model.json record) from a checkpoint/step-N folder."""
    from gamma_titan.convert.dcp_io import load_model_state
    from gamma_titan.convert.model_record import read_model_record
    from gamma_titan.models import TRAIN_SPECS

    checkpoint = Path(checkpoint)
    state = load_model_state(checkpoint, key=key)
    name, args, record = read_model_record(checkpoint, key=key)
    model = TRAIN_SPECS[name].model_cls(args)
    with torch.no_grad():  # TorchTitan's own init writes its leaves in place, as under its trainer's no_grad
        model.init_weights()  # buffers (the rotary cache); every parameter is then overwritten
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = {n for n, _ in model.named_parameters()}
    if unexpected or params & set(missing):
        raise ConfigError(f"{key}: {checkpoint} does not match its model.json "
                          f"(missing {sorted(params & set(missing))[:3]}, unexpected {sorted(unexpected)[:3]})")
    return model.eval(), record


def training_seq_len(checkpoint: Path) -> int | None:
    """training.seq_len of the run that wrote the checkpoint (its newest run record)."""
    run_dir = checkpoint.resolve().parent.parent  # <dump>/checkpoint/step-N
    records = sorted((run_dir / "runs").glob("*/config.toml"))
    if not records:
        return None
    record = read_toml(records[-1], "a record of the run that wrote the checkpoint: pass --seq-len, or move it aside")
    return record.get("training", {}).get("seq_len")


def read_tokens(data: str, tokenizer_dir: Path, count: int) -> np.ndarray:
    """The first `count` tokens of a split: "builtin_validation" / "builtin" (the built-in
    corpus, pretokenized with this tokenizer) or a shard folder from `gamma-titan pretokenize`
    (its validation split if it has one, else train)."""
    from gamma_titan.data.builtin_shards import ensure_builtin_shards
    from gamma_titan.data.shards import TokenShards, read_meta, tokenizer_info

    if data in ("builtin", "builtin_validation"):
        folder, split = ensure_builtin_shards(tokenizer_dir), "validation" if data == "builtin_validation" else "train"
    else:
        folder = Path(data)
        if not folder.is_dir():
            raise ConfigError(f"--data {data}: not builtin_validation, builtin or a shard folder")
        split = "validation" if "validation" in read_meta(folder, "--data")["splits"] else "train"
    shards = TokenShards(folder, split, key="--data", tokenizer=tokenizer_info(tokenizer_dir), tokenizer_key="--data")
    return shards.read(0, min(count, len(shards)))


@torch.no_grad()
def score(model, tokens: np.ndarray, seq_len: int, batch: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Per-token (loss, probability of the correct token) over non-overlapping windows of
    seq_len + 1 tokens (each window's first token is context only)."""
    windows = (len(tokens) - 1) // seq_len
    if windows < 1:
        raise ConfigError(f"--tokens: fewer than seq_len + 1 = {seq_len + 1} tokens to score")
    data = torch.as_tensor(tokens[: windows * seq_len + 1].astype(np.int64))
    inputs = data[:-1].view(windows, seq_len)
    targets = data[1:].view(windows, seq_len)
    losses = []
    for i in range(0, windows, batch):
        logits = model(inputs[i:i + batch]).float()
        losses.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets[i:i + batch],
                                                        reduction="none"))
    loss = torch.cat(losses).flatten().numpy().astype(np.float64)
    return loss, np.exp(-loss)


# --- the analysis ----------------------------------------------------------------------------


def delta_sym_p(p_small: np.ndarray, p_std: np.ndarray) -> np.ndarray:
    return (p_small - p_std) / np.maximum(p_small + p_std, 1e-30)


def difficulty_bins(loss_small: np.ndarray, loss_std: np.ndarray, bins: int = DIFFICULTY_BINS) -> list[dict[str, Any]]:
    """Tokens sorted by difficulty (mean of the two losses), split into `bins` groups of equal
    size (± 1): count, difficulty range and mean, mean gain (ℓ_std − ℓ_small) and Δ^sym p."""
    difficulty = (loss_small + loss_std) / 2
    order = np.argsort(difficulty, kind="stable")
    dsym = delta_sym_p(np.exp(-loss_small), np.exp(-loss_std))
    out = []
    for i, idx in enumerate(np.array_split(order, bins)):
        out.append({"bin": i + 1, "count": int(len(idx)), "difficulty_min": float(difficulty[idx].min()),
                    "difficulty_max": float(difficulty[idx].max()), "difficulty_mean": float(difficulty[idx].mean()),
                    "gain_mean": float((loss_std[idx] - loss_small[idx]).mean()),
                    "delta_sym_p_mean": float(dsym[idx].mean())})
    return out


def paired_spread(gain: np.ndarray, seq_len: int) -> dict[str, Any]:
    """The gain's spread over whole sequences of seq_len tokens: their count, the standard
    deviation of their mean gains (ddof 1) and the standard error of the overall mean gain."""
    per_sequence = gain[: len(gain) // seq_len * seq_len].reshape(-1, seq_len).mean(axis=1)
    n = len(per_sequence)
    std = float(per_sequence.std(ddof=1)) if n > 1 else float("nan")
    return {"seq_len": seq_len, "sequences": n, "std": std, "stderr": std / np.sqrt(n) if n > 1 else float("nan")}


def analyse(loss_small: np.ndarray, loss_std: np.ndarray, seq_len: int | None = None) -> dict[str, Any]:
    """The token-level statistics; with seq_len, the paired per-sequence spread too (the
    losses are whole windows of seq_len tokens, in order)."""
    dsym = delta_sym_p(np.exp(-loss_small), np.exp(-loss_std))
    counts, edges = np.histogram(dsym, bins=HIST_BINS, range=(-1.0, 1.0))
    gain = loss_std - loss_small
    paired = {}
    if seq_len:
        # with each model's own per-sequence spread: what an unpaired comparison would face
        paired = {"paired": {**paired_spread(gain, seq_len),
                             "own_std_small": paired_spread(loss_small, seq_len)["std"],
                             "own_std_std": paired_spread(loss_std, seq_len)["std"]}}
    return {
        "tokens": int(len(gain)),
        "loss_small": float(loss_small.mean()), "loss_std": float(loss_std.mean()), "gain_mean": float(gain.mean()),
        "delta_sym_p": {"mean": float(dsym.mean()), "median": float(np.median(dsym)),
                        "fraction_above_0.1": float((dsym > 0.1).mean()),
                        "fraction_below_-0.1": float((dsym < -0.1).mean()),
                        "histogram": {"edges": edges.tolist(), "counts": counts.tolist()}},
        "difficulty_bins": difficulty_bins(loss_small, loss_std),
        **paired,
    }


# --- outputs -------------------------------------------------------------------------------


def _plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = result["delta_sym_p"]["histogram"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.stairs(hist["counts"], hist["edges"], fill=True, alpha=0.7)
    ax.set_yscale("log")
    ax.set_xlabel("Δ^sym p = (p_small − p_std) / (p_small + p_std)")
    ax.set_ylabel("tokens")
    fig.tight_layout()
    fig.savefig(out / "delta_sym_p.png", dpi=110)
    plt.close(fig)
    bins = result["difficulty_bins"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([b["bin"] for b in bins], [b["gain_mean"] for b in bins],
           color=["tab:green" if b["gain_mean"] > 0 else "tab:red" for b in bins])
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks([b["bin"] for b in bins])
    ax.set_xlabel("difficulty decile (1 = easiest), difficulty = (ℓ_small + ℓ_std) / 2")
    ax.set_ylabel("mean gain ℓ_std − ℓ_small (nats)")
    fig.tight_layout()
    fig.savefig(out / "gain_by_difficulty.png", dpi=110)
    plt.close(fig)
    return [out / "delta_sym_p.png", out / "gain_by_difficulty.png"]


def token_html(pieces: list[str], gain: np.ndarray, loss_small: np.ndarray, loss_std: np.ndarray, title: str) -> str:
    """The text, each token's background green (small-init better) or red (worse), its
    strength the gain over the largest |gain| shown; hover shows the numbers."""
    scale = float(np.abs(gain).max()) or 1.0
    spans = []
    for piece, g, ls, lt in zip(pieces, gain, loss_small, loss_std):
        alpha = min(1.0, abs(float(g)) / scale)
        rgb = "0,160,60" if g > 0 else "220,40,40"
        tip = f"gain {g:+.3f} nats | loss small {ls:.3f}, std {lt:.3f}"
        spans.append(f'<span style="background: rgba({rgb},{alpha:.2f})" title="{html.escape(tip)}">'
                     f"{html.escape(piece)}</span>")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
            "pre{white-space:pre-wrap;font-family:monospace;line-height:1.6}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p>Per-token gain ℓ_std − ℓ_small: "
            f"<span style=\"background:rgba(0,160,60,0.8)\">small-init better</span> "
            f"<span style=\"background:rgba(220,40,40,0.8)\">small-init worse</span>; "
            f"full colour = {scale:.2f} nats. Hover a token for its losses.</p><pre>"
            + "".join(spans) + "</pre></body></html>\n")


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--out {out}: not empty; pass --overwrite to replace its files, or choose another folder")


def write_token_report(small: str | Path, std: str | Path, out: str | Path, *, data: str = "builtin_validation",
                       max_tokens: int = 100_000, text: str | None = None, seq_len: int | None = None,
                       overwrite: bool = False) -> list[Path]:
    out = Path(out)
    _check_out(out, overwrite)
    if max_tokens < 2:
        raise ConfigError(f"--tokens {max_tokens}: must be >= 2")
    model_small, rec_small = load_model(small, "CKPT_SMALL")
    model_std, rec_std = load_model(std, "CKPT_STD")
    if rec_small.get("tokenizer") != rec_std.get("tokenizer") or not rec_small.get("tokenizer"):
        raise ConfigError(f"CKPT_STD: trained with tokenizer {rec_std.get('tokenizer')}, CKPT_SMALL with "
                          f"{rec_small.get('tokenizer')}; token-level comparison needs the same tokenizer")
    tokenizer_dir = Path(rec_small["tokenizer"])
    if not (tokenizer_dir / TOKENIZER_FILE).is_file():
        raise ConfigError(f"CKPT_SMALL: its tokenizer {tokenizer_dir} (model.json) is gone")
    if seq_len is None:  # the small model's training context, else its rotary length
        seq_len = training_seq_len(Path(small)) or rec_small["args"]["max_seq_len"]
    if seq_len < 1 or seq_len > min(rec_small["args"]["max_seq_len"], rec_std["args"]["max_seq_len"]):
        raise ConfigError(f"--seq-len {seq_len}: must be between 1 and the models' max_seq_len")
    tokens = read_tokens(data, tokenizer_dir, max_tokens)
    loss_small, _ = score(model_small, tokens, seq_len)
    loss_std, _ = score(model_std, tokens, seq_len)
    result = analyse(loss_small, loss_std, seq_len)
    result.update(small=str(small), std=str(std), data=data, seq_len=seq_len,
                  definitions={"gain": "loss_std - loss_small (nats)",
                               "delta_sym_p": "(p_small - p_std) / (p_small + p_std)",
                               "difficulty": "(loss_small + loss_std) / 2; ten equal-sized bins"})
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokens.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    written = [out / "tokens.json", *_plots(result, out)]

    from gamma_titan.data.tokenizer import TOKENIZER_HINT

    tokenizer = load_tokenizer(tokenizer_dir / TOKENIZER_FILE, TOKENIZER_HINT)
    if text:
        ids = np.asarray(tokenizer.encode(text).ids, dtype=np.int64)
        title = "per-token gain on the given text"
    else:
        ids = tokens[: min(HTML_TOKENS, seq_len) + 1]
        title = f"per-token gain on the first {len(ids) - 1} tokens of {data}"
    ids = ids[: seq_len + 1]
    if len(ids) < 2:
        raise ConfigError("--text: needs at least two tokens")
    text_small, _ = score(model_small, ids, len(ids) - 1)
    text_std, _ = score(model_std, ids, len(ids) - 1)
    pieces = [tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids[1:]]
    page = token_html(pieces, text_std - text_small, text_small, text_std, title)
    (out / "tokens.html").write_text(page, encoding="utf-8")
    written.append(out / "tokens.html")

    d = result["delta_sym_p"]
    lines = [f"# Token-level analysis: {Path(small).name} (small init) vs {Path(std).name} (standard)", "",
             f"{result['tokens']} tokens of {data}, context {seq_len}. Mean loss: small {result['loss_small']:.4f}, "
             f"standard {result['loss_std']:.4f}, gain {result['gain_mean']:+.4f} nats.", "",
             f"Paired over {result['paired']['sequences']} sequences of {seq_len} tokens: the gain's standard "
             f"error is {result['paired']['stderr']:.4f} nats (per-sequence spread of the gain "
             f"{result['paired']['std']:.4f}; of each model's own loss {result['paired']['own_std_small']:.4f} "
             f"and {result['paired']['own_std_std']:.4f}).", "",
             f"Δ^sym p = (p_small − p_std)/(p_small + p_std): mean {d['mean']:+.4f}, median {d['median']:+.4f}; "
             f"{d['fraction_above_0.1']:.1%} of tokens above +0.1, {d['fraction_below_-0.1']:.1%} below −0.1.", "",
             "| difficulty bin | tokens | difficulty (mean) | mean gain (nats) | mean Δ^sym p |", "|---|---|---|---|---|"]
    for b in result["difficulty_bins"]:
        lines.append(f"| {b['bin']} | {b['count']} | {b['difficulty_mean']:.3f} | {b['gain_mean']:+.4f} | "
                     f"{b['delta_sym_p_mean']:+.4f} |")
    lines += ["", "![Δ^sym p](delta_sym_p.png) ![gain by difficulty](gain_by_difficulty.png)", "",
              "[the text, coloured by per-token gain](tokens.html)", ""]
    (out / "summary.md").write_text("\n".join(lines), encoding="utf-8")
    written.append(out / "summary.md")
    return written
