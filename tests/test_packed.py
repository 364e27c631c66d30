"""PackedSequences: the global batch does not depend on the data-parallel degree."""

import pytest
import torch

import gamma_titan  # noqa: F401
from gamma_titan.data.packed import PackedSequences
from gamma_titan.errors import ConfigError

TOKENS = torch.arange(1000)
SEQ = 10


def batches(rank: int, world: int, batch: int, n: int, start_state=None):
    ds = PackedSequences(TOKENS, SEQ, rank, world, batch)
    if start_state:
        ds.load_state_dict(start_state)
    it = iter(ds)
    out = []
    for _ in range(n):
        samples = [next(it) for _ in range(batch)]
        out.append((torch.stack([s[0]["input"] for s in samples]), torch.stack([s[1] for s in samples])))
    return out, ds.state_dict()


def test_samples_are_consecutive_windows_with_shifted_labels():
    (inputs, labels), = batches(0, 1, 2, 1)[0]
    assert inputs[0].tolist() == list(range(0, 10)) and labels[0].tolist() == list(range(1, 11))
    assert inputs[1].tolist() == list(range(10, 20))


@pytest.mark.parametrize("world", [2, 4])
def test_union_of_ranks_is_the_single_process_batch(world):
    single, _ = batches(0, 1, 8, 30)  # 30 global batches of 8 wrap past the 99 samples
    per_rank = [batches(r, world, 8 // world, 30)[0] for r in range(world)]
    for step, (inputs, labels) in enumerate(single):
        torch.testing.assert_close(torch.cat([per_rank[r][step][0] for r in range(world)]), inputs)
        torch.testing.assert_close(torch.cat([per_rank[r][step][1] for r in range(world)]), labels)


def test_resume_gives_the_same_next_batches():
    whole, _ = batches(1, 2, 3, 20)
    first, state = batches(1, 2, 3, 7)
    rest, _ = batches(1, 2, 3, 13, start_state=state)
    for a, b in zip(whole, first + rest):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_too_little_data_is_a_config_error():
    with pytest.raises(ConfigError, match="training.dataset"):
        PackedSequences(torch.arange(50), 10, 0, 2, 4)
