"""The paper's instruments while a run is alive (`[gamma.diagnostics]`).

At step 1 and every `freq` steps, after the optimizer step, `LiveDiagnostics.measure`:

* runs one forward of a fixed probe batch (the first `probe_batch` sequences of the
  validation split) in eval mode under no_grad, hooked by `ActivationProbe`: sink score,
  residual flow, ε-dominated fractions, gate statistics. The forward stops at the final
  norm (`head=False`): no vocabulary-sized logits (the debug model's 4 × 256 probe peaks
  at 11.3 MiB without them, 17.0 MiB with);
* computes the stable rank of every weight matrix (per expert stack: mean and min);
* at step 1 and every 10·freq steps, row-cosine maps of a few chosen matrices.

All numbers stay on the device until the end, where one transfer brings them to the host
(the measurement's only host sync on a GPU; the row-cosine maps are read when drawn).

The forward gets the attention masks the trainer's steps get (a flex flavor's
block-causal mask, from the probe batch's EOS tokens).

Training must not notice: the forward runs eagerly (compiled blocks are bypassed, so no
recompilation; a flex flavor's attention kernel stays compiled on a GPU), every model buffer (MoE load counters, expert bias) is restored
afterwards, and the RNG state is forked, so a run with diagnostics has bitwise the same
losses as one without. Every rank runs the probe (FSDP, TP and EP forwards are
collectives) on the same batch, so results do not depend on the data-parallel degree.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from gamma_titan.init import canonical_name

from .buffers import buffers_restored
from .probe import ActivationProbe, to_host
from .spectral import StableRanks, leading_rows, row_cosine


def reshard(model: nn.Module) -> None:
    """Free the whole parameters a forward outside training left gathered: FSDP2 does not
    reshard the root module after its forward (the backward would need them), so without a
    backward the model's parameters stay the unsharded ones, which the optimizer does not
    hold; a checkpoint saved at the same step then fails (measured: `KeyError` in
    get_optimizer_state_dict at the first save after a probe, on 2 FSDP ranks)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


PREFIX = "gamma/"
#: Row-cosine maps come every this many diagnostics intervals.
COSINE_EVERY = 10


def diagnostics_due(cfg, step: int) -> bool:
    return cfg.enable and (step == 1 or step % cfg.freq == 0)


def cosine_due(cfg, step: int) -> bool:
    return cfg.enable and (step == 1 or step % (COSINE_EVERY * cfg.freq) == 0)


def weight_matrices(model: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> every weight with two or more dimensions (3-D: expert stacks)."""
    return {canonical_name(n): p for n, p in model.named_parameters() if p.ndim >= 2}


def cosine_image(similarity: torch.Tensor) -> torch.Tensor:
    """A (rows, rows) map in [-1, 1] as an RGB image (H, W, 3) uint8, red = +1, blue = −1."""
    from matplotlib import colormaps

    rgba = colormaps["RdBu_r"]((similarity.clamp(-1, 1).cpu().numpy() + 1) / 2)
    return torch.from_numpy((rgba[..., :3] * 255).round().astype("uint8"))


def build_probe_batch(job_config, tokenizer) -> torch.Tensor:
    """The first `probe_batch` sequences (training seq_len) of the validation dataset, as
    (probe_batch, seq_len) token ids; the same on every rank."""
    from gamma_titan.data.loader import probe_tokens

    return probe_tokens(job_config, job_config.gamma.diagnostics.probe_batch, tokenizer)


class LiveDiagnostics:
    """`masks`: for a model that takes attention masks, the ones the trainer builds for the
    probe tokens (models/common/masks.py `trainer_masks`; flex: block-causal at EOS)."""

    def __init__(self, cfg, model: nn.Module, probe_tokens: torch.Tensor,
                 tp_group=None, cosine_params: list[str] | None = None, masks=None):
        self.cfg, self.model, self.tokens, self.tp_group, self.masks = cfg, model, probe_tokens, tp_group, masks
        self.stable_ranks = StableRanks()
        matrices = [n for n, w in weight_matrices(model).items() if w.ndim == 2]
        self.cosine_params = cosine_params or cfg.cosine_params or [
            n for n in model.model_args.default_cosine_params() if n in matrices]

    # --- the three measurements --------------------------------------------------------

    def activations(self) -> dict[str, float]:
        return to_host(self._activations())

    def weights(self) -> dict[str, float]:
        return to_host(self._weights())

    @torch.no_grad()
    def _activations(self) -> dict[str, torch.Tensor]:
        """The probe's numbers, on the device. The forward stops at the final norm (its
        hooks see everything the probe reads): no vocabulary-sized logits."""
        model = self.model
        was_training = model.training
        device = self.tokens.device
        rng_devices = [device] if device.type == "cuda" else []
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(buffers_restored(model))
                stack.enter_context(torch.random.fork_rng(devices=rng_devices))
                stack.enter_context(torch.compiler.set_stance("force_eager"))
                probe = stack.enter_context(ActivationProbe(model, self.tp_group))
                model.eval()
                model(self.tokens, self.masks, head=False)
        finally:
            model.train(was_training)
            reshard(model)
        return probe.metric_tensors()

    @torch.no_grad()
    def _weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, ranks in self.stable_ranks.all(weight_matrices(self.model)).items():
            if ranks.ndim == 0:
                out[f"stable_rank/{name}"] = ranks
            else:  # an expert stack: one stable rank per expert
                out[f"stable_rank/{name}/mean"] = ranks.mean()
                out[f"stable_rank/{name}/min"] = ranks.min()
        return out

    @torch.no_grad()
    def cosine_maps(self) -> dict[str, torch.Tensor]:
        weights = weight_matrices(self.model)
        return {f"{PREFIX}cosine/{name}": row_cosine(leading_rows(weights[name], self.cfg.cosine_rows))
                for name in self.cosine_params}

    # --- warm state, checkpointed with the run (exact resume) ----------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stable ranks' warm-start vectors, (1 or E, d_in) per weight and the same on
        every rank, so a resumed run measures what an uninterrupted one would. Zeros stand
        for a weight not measured yet (DCP loads into tensors of known shape)."""
        state = {}
        for name, weight in weight_matrices(self.model).items():
            shape = (1 if weight.ndim == 2 else weight.shape[0], weight.shape[-1])
            vector = self.stable_ranks.vectors.get(name)
            state[name] = vector if vector is not None else torch.zeros(shape, device=self.tokens.device)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        names = list(state)
        measured = torch.stack([state[n].abs().sum() > 0 for n in names]).tolist() if names else []
        self.stable_ranks.vectors = {n: state[n] for n, keep in zip(names, measured) if keep}

    # --- one call per due step -----------------------------------------------------

    def measure(self, step: int, with_images: bool) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """Every rank must call this at the same steps (collectives). Returns scalar
        metrics (tag -> value) and row-cosine maps (tag -> similarity matrix)."""
        start = time.perf_counter()
        metrics = to_host({**self._activations(), **self._weights()})  # the one host sync
        maps = self.cosine_maps() if with_images and cosine_due(self.cfg, step) else {}
        metrics = {PREFIX + k: v for k, v in metrics.items()}
        metrics[PREFIX + "diagnostics_seconds"] = time.perf_counter() - start
        return metrics, maps
