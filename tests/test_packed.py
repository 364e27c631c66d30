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
