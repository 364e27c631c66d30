"""Parallel layouts: the degrees of `[parallelism]` resolved for a world size, and the rules
that refuse, before anything starts, a layout that would not train the model it names.

A layout splits the world's ranks into pipeline stages (pp), replicas (replicate), FSDP
shards (shard), context-parallel (cp) and tensor-parallel (tp) groups; expert parallelism
(ep, and expert TP: etp) re-splits the shard x cp x tp ranks for the routed experts, as
TorchTitan's ParallelDims does. How a family applies a layout is its `parallelize.py`.

Every refusal is one line that names the degrees and ends with a layout that works on the
same number of ranks (`LayoutError.instead`): the first of the rule's own candidates, then
of a few general ones (no TP, no EP, no CP, no PP, FSDP over every rank), that no rule
refuses. The README's layout table is these rules, for each family, and tests/test_layouts.py
trains every layout they accept against one process.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from gamma_titan.errors import ConfigError

#: Layout field -> its [parallelism] key.
KEYS = {"replicate": "data_parallel_replicate_degree", "shard": "data_parallel_shard_degree",
        "tp": "tensor_parallel_degree", "cp": "context_parallel_degree", "pp": "pipeline_parallel_degree",
        "ep": "expert_parallel_degree", "etp": "expert_tensor_parallel_degree"}


@dataclass(frozen=True)
class Layout:
    """The degrees of one layout, all resolved (no -1)."""

    replicate: int = 1
    shard: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def world(self) -> int:
        return self.replicate * self.shard * self.tp * self.cp * self.pp

    @property
    def data_parallel(self) -> int:
        """Ranks a global batch is split over."""
        return self.replicate * self.shard

    @property
    def expert_shard(self) -> int:
        """FSDP degree of the routed experts under EP (TorchTitan's `efsdp`)."""
        return self.shard * self.cp * self.tp // (self.etp * self.ep)

    def refit(self, world_size: int, **degrees: int) -> Layout | None:
        """These degrees on `world_size` ranks, the shard degree taking up the rest unless
        given; None when they do not fit the world."""
        changed = replace(self, **{"shard": 1, **degrees})
        if "shard" not in degrees and world_size % changed.world == 0:
            changed = replace(changed, shard=world_size // changed.world)
        return changed if changed.world == world_size else None

    def describe(self) -> str:
        """The degrees above 1, e.g. "replicate 2 x tp 2" ("one rank" for none)."""
        parts = [f"{f.name} {getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) > 1]
        return " x ".join(parts) or "one rank"

    def flags(self, against: Layout | None = None) -> str:
        """The command-line flags that ask for this layout: those of the degrees that differ
        from `against` (all of them without it)."""
        return " ".join(f"--parallelism.{KEYS[f.name]} {getattr(self, f.name)}" for f in fields(self)
                        if against is None or getattr(self, f.name) != getattr(against, f.name))

    def kind(self) -> tuple[str, ...]:
        """What the layout parallelises, independent of the degrees' sizes: the dimensions
        above 1, plus "experts sharded" when EP leaves expert FSDP ranks (efsdp > 1)."""
        kind = tuple(f.name for f in fields(self) if getattr(self, f.name) > 1)
        return kind + (("experts sharded",) if self.ep > 1 and self.expert_shard > 1 else ())


def nearest_degree(asked: int, room: int, experts: int | None = None) -> int:
    """The expert-parallel degree nearest `asked` (the larger on a tie) that divides `room`
    (the data-parallel shard x context degrees) and, where known, the routed experts."""
    fits = [d for d in range(1, room + 1) if room % d == 0 and (experts is None or experts % d == 0)]
    return min(fits, key=lambda d: (abs(d - asked), -d))


class LayoutError(ConfigError):
    """A layout refused; `instead` is the layout the message ends with (same world size)."""

    def __init__(self, problem: str, asked: Layout, instead: Layout):
        self.asked, self.instead = asked, instead
        super().__init__(f"{problem}; use {instead.flags(against=asked)} ({instead.describe()})")


@dataclass(frozen=True)
class LayoutRules:
    """Which layouts a model trains on this machine: `args` is the model's args (None:
    the rules every model shares), `name` its model.name, `cuda` whether CUDA is here."""

    args: object = None
    name: str = "this model"
    cuda: bool = False

    def resolve(self, parallelism, world_size: int) -> Layout:
        """The config's degrees, the shard degree -1 resolved as TorchTitan does (the ranks
        left over), checked: a LayoutError names the first rule it breaks."""
        degrees = {name: getattr(parallelism, key) for name, key in KEYS.items()}
        shard = degrees.pop("shard")
        asked = Layout(**degrees, shard=1 if shard == -1 else shard)
        if shard == -1 and world_size % asked.world:
            raise self._refusal(f"world size {world_size} is not divisible by the replicate x tensor x context x "
                                f"pipeline degrees ({asked.world})", asked, [], world_size)
        if shard == -1:
            asked = replace(asked, shard=world_size // asked.world)
        if asked.world != world_size:
            raise self._refusal(f"parallelism.data_parallel_shard_degree = {shard}: the degrees multiply to "
                                f"{asked.world} but the world size is {world_size}", asked,
                                [asked.refit(world_size)], world_size)
        self.check(asked)
        return asked

    def check(self, layout: Layout) -> None:
        found = self.problem(layout)
        if found is not None:
            problem, candidates = found
            raise self._refusal(problem, layout, candidates, layout.world)

    def _refusal(self, problem: str, asked: Layout, candidates: list, world: int) -> LayoutError:
        general = [asked.refit(world, tp=1, etp=1), replace(asked, ep=1, etp=1), asked.refit(world, cp=1),
                   asked.refit(world, pp=1), asked.refit(world, replicate=1, tp=1, cp=1, pp=1, ep=1, etp=1),
                   Layout(replicate=world)]  # DDP: for a model whose own rule refuses sharding
        instead = next((c for c in candidates + general
                        if c is not None and c != asked and c.world == world and self.problem(c) is None),
                       Layout(shard=world))
        return LayoutError(problem, asked, instead)

    def problem(self, layout: Layout) -> tuple[str, list[Layout | None]] | None:
        """The first rule `layout` breaks, with the rule's own candidates for a layout that
        works; None when it trains."""
        args, name, world = self.args, self.name, layout.world
        pp, cp, tp, ep, etp, rep, shard = (layout.pp, layout.cp, layout.tp, layout.ep, layout.etp, layout.replicate,
                                           layout.shard)
        if args is not None:
            if pp > 1 and not args.supports_pipeline_parallel():
                return (f"parallelism.pipeline_parallel_degree = {pp}: {name} supports 1 (no pipeline parallelism)",
                        [layout.refit(world, pp=1)])
            if cp > 1 and not args.supports_context_parallel():
                # TorchTitan's CP shards the sequence and passes positions= to the model: a
                # forward without them would rotate each chunk as if it began at position 0.
                return (f"parallelism.context_parallel_degree = {cp}: {name} supports 1 (no context parallelism)",
                        [layout.refit(world, cp=1)])
        if cp > 1 and not self.cuda:
            # Measured with torch 2.13: DTensor has no sharding strategy for the CPU's SDPA
            # kernels (aten._scaled_dot_product_flash_attention_for_cpu), so ring attention
            # fails at the first forward. tools/gpu_check.sh runs context parallelism on GPUs.
            return (f"parallelism.context_parallel_degree = {cp}: context parallelism needs CUDA SDPA kernels "
                    "(PyTorch has no CPU ring attention)", [layout.refit(world, cp=1)])
        if args is not None and tp > 1 and args.tensor_parallel_shards_sdpa() and not self.cuda:
            # Measured with torch 2.13 (TorchTitan's qwen3, TP 2, gloo): the first forward raises
            # "aten._scaled_dot_product_flash_attention_for_cpu does not have a sharding strategy".
            return (f"parallelism.tensor_parallel_degree = {tp}: {name}'s tensor parallelism shards SDPA's inputs, "
                    "which needs CUDA SDPA kernels", [layout.refit(world, tp=1, etp=1)])
        if args is not None and ep > 1 and args.expert_parallel_divisor() == 1:
            return (f"parallelism.expert_parallel_degree = {ep} applies to MoE models; {name} has no experts",
                    [replace(layout, ep=1, etp=1)])
        if args is not None and ep > 1 and args.expert_parallel_needs_cuda() and not self.cuda:
            # Measured (TorchTitan's deepseek_v3, EP 2, gloo): the first forward fails in the
            # Triton kernel that permutes the received tokens ("0 active drivers").
            return (f"parallelism.expert_parallel_degree = {ep}: {name}'s expert parallelism (TorchTitan's) orders "
                    "tokens with a Triton kernel, which needs CUDA", [replace(layout, ep=1, etp=1)])
        if etp > 1 and ep == 1:
            # TorchTitan builds its expert-TP mesh for EP only; without EP the experts follow TP.
            return (f"parallelism.expert_tensor_parallel_degree = {etp} applies with expert parallelism only "
                    "(expert_parallel_degree > 1)", [replace(layout, etp=1)])
        if rep > 1 and shard == 1 and cp == 1 and (tp > 1 or pp > 1):
            # Replicas without shards are DDP, which TorchTitan applies to 1-D layouts only (its
            # llama3 raises "DDP has not supported > 1D parallelism" once started; applied
            # anyway, it would train on empty parameters).
            return (f"parallelism.data_parallel_replicate_degree = {rep} with data_parallel_shard_degree = 1 and "
                    f"{layout.describe()}: replicas without shards are DDP, which takes no other parallelism",
                    [layout.refit(world, replicate=1), layout.refit(world, replicate=1, shard=rep)])
        if ep > 1 and (shard * cp) % ep:
            experts = args.expert_parallel_divisor() if args is not None else None
            fit = nearest_degree(ep, shard * cp, experts)
            return (f"parallelism.expert_parallel_degree = {ep} must divide the data-parallel shard degree "
                    f"({shard}) x context parallel degree ({cp})", [replace(layout, ep=fit, etp=etp if fit > 1 else 1)])
        if args is not None:
            refused = self.parallelize_contract().layout_problem
            problem = refused(layout) if refused is not None else None
            if problem is not None:
                return problem, []
            try:
                args.check_parallelism(layout)
            except ConfigError as e:
                return str(e), []
        return None

    def parallelize_contract(self):
        """What the parallelize function of the model's TrainSpec declares it cannot take
        (models/common/parallelize.py ParallelizeContract): shared by every family using it."""
        from torchtitan.protocols.train_spec import get_train_spec

        from gamma_titan.models.common.parallelize import contract_of
        from gamma_titan.training.train_spec import register_families

        register_families()
        return contract_of(get_train_spec(self.name).parallelize_fn)
