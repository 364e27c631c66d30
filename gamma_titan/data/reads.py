"""What a run reads, said at its start: each training source with its weight, its tokens and
the epochs this run takes of it, the validation source and the run's validation set (how
many sequences and tokens, the same at any layout), the tokenizer and its vocabulary.
Logged (console and train.log) and kept in the run record's run.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gamma_titan.data.names import is_shard_dataset


def what_it_reads(job_config, vocab_size: int, global_batch: int) -> dict[str, Any]:
    """{"tokenizer": ..., "training": [...], "validation": [...] or None, "validation_set":
    {...} when the run validates on a shard dataset}. `global_batch`: sequences a step, so
    the run reads training.steps x global_batch sequences."""
    from gamma_titan.data.loader import validation_set
    from gamma_titan.data.shard_sources import open_samples
    from gamma_titan.data.tokenizer import resolve_tokenizer_path, tokenizer_vocab_size

    tokenizer = resolve_tokenizer_path(job_config.model.hf_assets_path)
    report: dict[str, Any] = {"tokenizer": {"path": str(tokenizer), "vocab_size": tokenizer_vocab_size(tokenizer),
                                            "model_vocab_size": vocab_size}}
    sections = {"training": job_config.training.steps * global_batch}
    if job_config.validation.enable or job_config.gamma.diagnostics.enable:
        sections["validation"] = None  # read from its start on every pass
    for section, sequences in sections.items():
        cfg = getattr(job_config, section)
        if not is_shard_dataset(cfg.dataset):  # tokenized as it is read: no count up front
            report[section] = [{"name": f"{cfg.dataset} {cfg.dataset_path or ''}".strip(), "weight": 1.0,
                                "tokens": None, "epochs": None}]
            continue
        samples = open_samples(job_config, section, cfg.seq_len, tokenizer)
        streams, weights = (samples.sources, samples.weights) if hasattr(samples, "weights") else ([samples], [1.0])
        report[section] = [{"name": s.name, "weight": w, "tokens": len(s.tokens),
                            "epochs": sequences * w / s.n if sequences is not None and s.n else None}
                           for s, w in zip(streams, weights)]
    v = job_config.validation
    if v.enable and is_shard_dataset(v.dataset):
        held = validation_set(job_config)
        report["validation_set"] = {
            "sequences": held.size, "tokens": held.tokens(v.seq_len), "requested": held.requested,
            "capped": held.capped, "per_source": {n: len(d) for n, d in zip(held.source_names, held.draws)}}
    return report


def reads_lines(report: dict[str, Any]) -> list[str]:
    """The report as log lines, one per source."""
    tok = report["tokenizer"]
    lines = [f"reads: tokenizer {Path(tok['path'])} ({tok['vocab_size']:,} tokens; the model's vocabulary "
             f"{tok['model_vocab_size']:,})"]
    for section in ("training", "validation"):
        for source in report.get(section) or []:
            tokens = f"{source['tokens']:,} tokens" if source["tokens"] is not None else "tokens counted as read"
            epochs = f", {source['epochs']:.3g} epochs in this run" if source["epochs"] is not None else ""
            lines.append(f"reads: {source['name']}: weight {source['weight']:.3g}, {tokens}{epochs}")
    held = report.get("validation_set")
    if held:
        asked = ("the whole split (validation.steps = -1)" if held["requested"] is None else
                 f"validation.steps x validation.local_batch_size = {held['requested']:,}")
        sources = ""
        if len(held["per_source"]) > 1:
            sources = "; " + ", ".join(f"{name} {n:,}" for name, n in held["per_source"].items())
        lines.append(f"reads: validation set: {held['sequences']:,} sequences ({held['tokens']:,} tokens), the same "
                     f"at any layout and after any resume ({asked}){sources}")
        if held["capped"]:
            lines.append(f"WARNING: validation set: {held['requested']:,} sequences asked, the validation split "
                         f"holds {held['sequences']:,}: each is validated once")
    return lines
