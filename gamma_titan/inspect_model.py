"""`gamma-titan inspect`: what a config's model looks like at initialisation, on a laptop.

For every parameter: its γ group, fan-in, target std d_in^(−γ) and measured std. For the
model: parameter count, training FLOPs per token (gate included), the hidden-state
variance σ²(h) at every RMSNorm input next to ε, whether ε dominates it (the paper's
§2.1 masking: warn when ε > 0.1·σ²(h)), and the residual-flow ratio ‖h_L − e‖/‖e‖ of a
forward pass at init (§2.4: ≍ d^(1−γ)).

The model is built on the meta device and materialised one block at a time, each block
initialised exactly as in training (same per-parameter seeds) and freed after its
forward pass, so a 7B config inspects in a few GB of CPU memory. A TorchTitan model
without [gamma] init_rate keeps TorchTitan's init, which initialises the whole model at
once: it is materialised whole (its γ and target std are then blank). The walk is
models/common/norm_inputs.py's, which the recipe planner's ε check shares.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
from torch import nn

from gamma_titan.diagnostics.probe import EPS_DOMINANCE, eps_dominates
from gamma_titan.init import ParamInit
from gamma_titan.models.common.norm_inputs import (PROBE_BATCH, PROBE_LEN, forward_at_init, param_plan, probe_seed,
                                                   probe_tokens)


def _param_rows(module: nn.Module, plan: list[ParamInit], measure: bool) -> list[dict]:
    rows = []
    for entry, param in zip(plan, module.parameters()):
        row = {
            "name": entry.name,
            "group": entry.group,
            "shape": list(param.shape),
            "fan_in": entry.fan_in,
            "gamma": entry.gamma,
            "target_std": entry.std,
        }
        if measure:
            data = param.detach().float()
            row["std"] = data.std().item() if entry.fan_in is not None else None
            row["mean"] = data.mean().item()
        rows.append(row)
    return rows


@torch.no_grad()
def inspect_model(spec, args, seq_len: int, measure: bool = True, probe_batch: int = PROBE_BATCH,
                  probe_len: int = PROBE_LEN, seed: int | None = None, tokenizer=None) -> dict:
    """The report as a plain dict (the `--json` output). `tokenizer` (its eos_id): for a
    model that takes attention masks, the walk's are the trainer's (block-causal at EOS)."""
    titan_init = args.init is None  # TorchTitan's own init (models/titan, no [gamma] init_rate)
    if seed is None:
        seed = probe_seed(args)
    cfg = None if titan_init else dataclasses.replace(args.init, seed=seed)
    with torch.device("meta"):
        model = spec.model_cls(args)
    n_params = sum(p.numel() for p in model.parameters())
    _, flops = args.get_nparams_and_flops(model, seq_len)
    report = {
        "model": type(model).__name__,
        "n_params": n_params,
        "flops_per_token": flops,
        "seq_len": seq_len,
        "active_params": args.active_params(),
        **knobs(args),
        "measured": measure,
    }
    if not measure:
        rows = [
            {"name": e.name, "group": e.group, "shape": list(p.shape), "fan_in": e.fan_in,
             "gamma": e.gamma, "target_std": e.std}
            for e, p in zip(param_plan(model, cfg, model.init_rule), model.parameters())
        ]
        report["params"] = rows
        return report

    rows: list[dict] = []
    tokens = probe_tokens(args.vocab_size, seq_len, seed, probe_batch, probe_len)
    walk = forward_at_init(model, cfg, seed, tokens, tokenizer=tokenizer,
                           on_part=lambda part, plan: rows.extend(_param_rows(part, plan, True)))
    site, hidden_var = walk.smallest()
    e, h = walk.embedding, walk.hidden
    report.update(
        params=rows,
        norm_sites=[{"name": k, "var": v} for k, v in walk.norm_inputs.items()],
        hidden_var=hidden_var,
        hidden_var_site=site,
        eps_dominated=eps_dominates(args.norm_eps, hidden_var),
        residual_flow_ratio=((h - e).norm() / e.norm()).item(),
        embedding_var=e.pow(2).mean().item(),
        final_hidden_var=h.pow(2).mean().item(),
        logits_std=walk.logits.float().std().item(),
        probe_tokens=list(tokens.shape),
    )
    return report


def tokens_per_step(config) -> dict:
    """What one optimizer step trains on: pinned by training.global_batch_size, else it
    grows with the data-parallel degree."""
    t = config.training
    if t.global_batch_size > 0:
        return {"sequences": t.global_batch_size, "seq_len": t.seq_len, "tokens": t.global_batch_size * t.seq_len}
    return {"sequences": None, "per_rank": t.local_batch_size, "seq_len": t.seq_len, "tokens": None}


def weight_decay_report(spec, args, policy: str) -> dict:
    """Values AdamW decays and does not under [optimizer] weight_decay_policy."""
    from gamma_titan.training.optimizer import decay_counts

    with torch.device("meta"):
        return decay_counts(spec.model_cls(args), policy)


def knobs_line(report: dict) -> str:
    """γ, ε and the gate as resolved (inspect_model's report, or `knobs(args)`)."""
    return ((f"γ = {report['init_rate']:g}" if report["init_rate"] is not None else "TorchTitan's init")
            + (f" (overrides {report['init_rate_overrides']})" if report["init_rate_overrides"] else "")
            + f", ε = {report['norm_eps']:g}, attention gate = {report['attention_gate']}")


def knobs(args) -> dict:
    """The three knobs of a family's args, as the report holds them."""
    titan_init = args.init is None
    return {"init_rate": None if titan_init else args.init.rate,
            "init_rate_overrides": {} if titan_init else dict(args.init.rate_overrides),
            "norm_eps": args.norm_eps, "attention_gate": args.attention_gate}


def norm_site_lines(sites: list[dict]) -> list[str]:
    """σ²(h) at every norm input, a line per block ("  layers.0: attention_norm 3.9e-03,
    ffn_norm 7.8e-03") and one for the norms outside the blocks."""
    groups: dict[str, list[str]] = {}
    for site in sites:
        parts = site["name"].split(".")
        block, local = (".".join(parts[:2]), ".".join(parts[2:])) if parts[0] == "layers" else ("outside blocks", site["name"])
        groups.setdefault(block, []).append(f"{local} {site['var']:.2g}")
    return ["σ²(h) at every norm input:"] + [f"  {block}: {', '.join(names)}" for block, names in groups.items()]


def format_report(report: dict) -> str:
    """The human-readable form: one line per (group, shape), then the model summary."""
    active = report.get("active_params")
    lines = [
        f"model {report['model']}: {report['n_params']:,} parameters"
        + (f" ({active:,} active per token: matmul weights incl. output head)" if active else "")
        + ", "
        f"{report['flops_per_token'] / 1e9:.3f} GFLOP/token for training at seq_len {report['seq_len']}",
        knobs_line(report),
        "",
        f"{'group':<10} {'shape':<16} {'count':>5} {'fan_in':>7} {'γ':>5} {'target std':>11} {'measured std':>18}",
    ]
    decay = report.get("weight_decay")
    if decay is not None:
        lines.insert(2, f"weight decay ({decay['policy']}): {decay['decayed']:,} values decayed, "
                        f"{decay['not_decayed']:,} not (biases and 1-D parameters)")
    step = report.get("tokens_per_step")
    if step is not None and step["tokens"]:
        lines.insert(2, f"tokens per step: {step['tokens']:,} ({step['sequences']} sequences x {step['seq_len']}, "
                        "training.global_batch_size: the same on any number of GPUs)")
    elif step is not None:
        lines.insert(2, f"tokens per step: {step['per_rank'] * step['seq_len']:,} x data-parallel degree "
                        f"({step['per_rank']} x {step['seq_len']} per rank; training.global_batch_size = -1)")
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in report["params"]:
        groups[(row["group"], tuple(row["shape"]))].append(row)
    for (group, shape), rows in groups.items():
        first = rows[0]
        scale = first["fan_in"] is None
        target = "1 (scale)" if scale else ("" if first["target_std"] is None else f"{first['target_std']:.4g}")
        measured = ""
        if report["measured"]:
            key = "mean" if scale else "std"
            vals = [r[key] for r in rows]
            measured = f"{min(vals):.4g}" if len(vals) == 1 else f"{min(vals):.4g}..{max(vals):.4g}"
        gamma = "" if first["gamma"] is None else f"{first['gamma']:g}"
        fan_in = "" if first["fan_in"] is None else str(first["fan_in"])
        shape_s = "x".join(map(str, shape))
        lines.append(f"{group:<10} {shape_s:<16} {len(rows):>5} {fan_in:>7} {gamma:>5} {target:>11} {measured:>18}")
    if report["measured"]:
        lines += [
            "",
            f"hidden variance at init σ²(h): {report['hidden_var']:.3g} (smallest over RMSNorm inputs, at "
            f"{report['hidden_var_site']}; embedding {report['embedding_var']:.3g}, final "
            f"{report['final_hidden_var']:.3g})",
            *norm_site_lines(report["norm_sites"]),
            f"norm_eps {report['norm_eps']:.3g} vs σ²(h): "
            + ("ε DOMINATES" if report["eps_dominated"] else "ok, ε is negligible")
            + f" (ε / σ²(h) = {report['norm_eps'] / report['hidden_var']:.3g}; dominated when > {EPS_DOMINANCE:g})",
            f"residual-flow ratio ‖h_L − e‖/‖e‖ at init: {report['residual_flow_ratio']:.4g}",
        ]
        if report["eps_dominated"]:
            lines.append(
                "WARNING: RMSNorm is ε-dominated at init: it no longer sees the scale of h, which "
                "masks the effect of small init (paper §2.1). Lower gamma.norm_eps (e.g. 1e-12)."
            )
    lines += report.get("attention_kernels", [])
    return "\n".join(lines)
