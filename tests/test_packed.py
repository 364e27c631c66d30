"""PackedSequences: the global batch does not depend on the data-parallel degree."""

import numpy as np
import pytest
import torch

import gamma_titan  # noqa: F401
from gamma_titan.data.rank_batches import PackedSequences
from gamma_titan.data.sampling import Sequences
from gamma_titan.errors import ConfigError

SEQ = 10


class ArrayTokens:
    """An in-memory token stream with the reading interface of data/shards.py's TokenShards."""

    def __init__(self, tokens):
        self.tokens = np.asarray(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop].copy()


def in_order(n_tokens=1000, shuffle=False):
    return Sequences(ArrayTokens(np.arange(n_tokens)), SEQ, shuffle=shuffle, seed=0, name="test", key="key")


def batches(rank: int, world: int, batch: int, n: int, start_state=None, shuffle=False):
    ds = PackedSequences(in_order(shuffle=shuffle), rank, world, batch)
    if start_state:
        ds.load_state_dict(start_state)
    it = iter(ds)
    out = []
    for _ in range(n):
        inputs, labels = next(it)
        out.append((inputs["input"], labels))
    return out, ds.state_dict()


def test_samples_are_consecutive_windows_with_shifted_labels():
    (inputs, labels), = batches(0, 1, 2, 1)[0]
    assert inputs[0].tolist() == list(range(0, 10)) and labels[0].tolist() == list(range(1, 11))
    assert inputs[1].tolist() == list(range(10, 20))


@pytest.mark.parametrize("world,shuffle", [(2, False), (4, True)])
def test_union_of_ranks_is_the_single_process_batch(world, shuffle):
    single, _ = batches(0, 1, 8, 30, shuffle=shuffle)  # 30 global batches of 8 wrap past the 99 samples
    per_rank = [batches(r, world, 8 // world, 30, shuffle=shuffle)[0] for r in range(world)]
    for step, (inputs, labels) in enumerate(single):
        torch.testing.assert_close(torch.cat([per_rank[r][step][0] for r in range(world)]), inputs)
        torch.testing.assert_close(torch.cat([per_rank[r][step][1] for r in range(world)]), labels)


def test_resume_gives_the_same_next_batches():
    whole, _ = batches(1, 2, 3, 20, shuffle=True)
    first, state = batches(1, 2, 3, 7, shuffle=True)
    rest, _ = batches(1, 2, 3, 13, start_state=state, shuffle=True)
    for a, b in zip(whole, first + rest):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_shuffled_epochs_are_permutations_that_differ():
    samples = in_order(shuffle=True)
    epochs = [[samples.get(g)[0] // SEQ for g in range(e * 99, (e + 1) * 99)] for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(99)) and epochs[0] != epochs[1]


def test_too_little_data_is_a_config_error():
    with pytest.raises(ConfigError, match="training.dataset = 'dataset': 4 sequences, fewer than one global batch"):
        PackedSequences(in_order(50), 0, 2, 4, on_exhausted="stop")
    with pytest.raises(ConfigError, match="key: test has 5 tokens, not enough for one sequence"):
        in_order(5)


@pytest.mark.parametrize("sequences", [1, 7, 10, None])
def test_the_validation_set_is_the_same_sequences_at_every_degree_each_once(sequences):
    """The first N sequences of a mixture (two streams, weights 3:1; None: the split), read by
    1-4 data-parallel ranks in local batches of 2: together they read each of them exactly
    once, source by source; every rank runs as many batches, the missing rows padded with
    ignored labels."""
    from gamma_titan.data.sampling import Mixture
    from gamma_titan.data.validation_set import ValidationSet

    streams = [Sequences(ArrayTokens(np.arange(offset, offset + 160)), SEQ, shuffle=False, seed=0, name=name,
                         key="key", source=name) for offset, name in ((0, "docs"), (10_000, "code"))]
    mixture = Mixture(streams, [3.0, 1.0])
    one = None
    for world in (1, 2, 3, 4):
        vset = ValidationSet(mixture, sequences)
        read, counts = [], set()
        for rank in range(world):
            batches_ = list(vset.rank_batches(rank, world, 2))
            counts.add(len(batches_))
            for inputs, labels, source in batches_:
                for row in range(inputs.shape[0]):
                    if (labels[row] != -100).any():
                        assert (labels[row] != -100).all()
                        read.append((source, int(inputs[row, 0])))
        assert counts == {vset.batches_per_rank(world, 2)}  # no rank waits for another
        assert len(read) == len(set(read)) == vset.size  # each sequence once
        if one is None:
            one = sorted(read)
        assert sorted(read) == one  # the same set at every degree
    expected = [mixture.get(g)[0] for g in range(len(one))]  # the first N of the global order
    assert sorted(int(first) for _, first in one) == sorted(int(x) for x in expected)
    assert {mixture.source_names[s] for s, _ in one} == ({"docs"} if len(one) == 1 else {"docs", "code"})
    first_wrap = next(g for g in range(10_000) if mixture.first_exhausted(g) is not None)
    if sequences is None:  # the split: every sequence before the first stream would wrap
        assert vset.size == first_wrap and not vset.capped
    capped = ValidationSet(mixture, 1000)  # more than the split holds: the split, once
    assert capped.size == first_wrap and capped.capped
