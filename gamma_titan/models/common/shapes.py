"""Shape rules every model family shares: the derived head sizes, and checks that each
raise a one-line ConfigError naming the [model_args] key."""

from gamma_titan.errors import ConfigError


class HeadShape:
    """Derived sizes of (grouped-query) multi-head attention, for args dataclasses with
    `dim`, `n_heads` and `n_kv_heads` (None: as many KV heads as query heads)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


def check_positive_ints(args, keys) -> None:
    for key in keys:
        value = getattr(args, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model_args.{key} = {value!r}: must be a positive integer")


def check_heads(args) -> None:
    """Multi-head / grouped-query attention: heads divide the width, even head dim."""
    if args.dim % args.n_heads:
        raise ConfigError(f"model_args.n_heads = {args.n_heads} does not divide model_args.dim = {args.dim}")
    if args.head_dim % 2:
        raise ConfigError(
            f"model_args.dim / model_args.n_heads = {args.head_dim}: the head dim must be even "
            "for rotary embeddings"
        )
    kv = args.kv_heads
    if not isinstance(kv, int) or kv <= 0 or args.n_heads % kv:
        raise ConfigError(
            f"model_args.n_kv_heads = {args.n_kv_heads!r} must be a positive divisor of "
            f"model_args.n_heads = {args.n_heads}"
        )


def check_rope(args) -> None:
    """The rotary base (the paper's knobs are checked once, with [gamma]: config/checks.py)."""
    if not args.rope_theta > 0:
        raise ConfigError(f"model_args.rope_theta = {args.rope_theta!r}: must be > 0")


def check_tensor_parallel(args, tp: int, widths: tuple[str, ...]) -> None:
    """Heads (query and KV) and the named MLP widths must split evenly across TP ranks."""
    if tp <= 1:
        return
    if args.n_heads % tp or args.kv_heads % tp:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree = {tp} must divide model_args.n_heads = "
            f"{args.n_heads} and the KV heads ({args.kv_heads})"
        )
    for key in widths:
        if getattr(args, key) % tp:
            raise ConfigError(f"parallelism.tensor_parallel_degree = {tp} must divide "
                              f"model_args.{key} = {getattr(args, key)}")
