"""The pipeline split pre-flight predicts (training/pipeline.py) against TorchTitan's own
split function, and a named split (module_fqns_per_model_part) that would drop, repeat or
reorder a module refused in one line. The runs themselves are in test_layouts.py."""

import pytest

from gamma_titan.config import load_job_config
from gamma_titan.errors import ConfigError
from gamma_titan.training.pipeline import check_pipeline
from helpers import REPO

N_LAYERS = 4  # configs/dense/debug.toml


def config(*overrides):
    return load_job_config(["--job.config_file", str(REPO / "configs/dense/debug.toml"),
                            "--parallelism.pipeline_parallel_degree", "2", "--gamma.diagnostics.enable", "false",
                            *overrides])


@pytest.mark.parametrize("schedule,stages", [
    ("1F1B", [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]),
    # two stages per rank: 6 weighted blocks in 4 stages, the last holding the head alone
    ("Interleaved1F1B", [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3"], ["norm", "output"]]),
])
def test_the_split_is_torchtitans(schedule, stages):
    # TorchTitan weighs the embedding and the head as one block each (first/last_stage_less_layers = 1)
    assert check_pipeline(config("--parallelism.pipeline_parallel_schedule", schedule), N_LAYERS, cuda=False) == stages


def named(stages, schedule="1F1B"):
    c = config("--parallelism.pipeline_parallel_schedule", schedule)
    c.parallelism.module_fqns_per_model_part = stages
    return check_pipeline(c, N_LAYERS, cuda=False)


def test_a_named_split_is_taken_as_written():
    stages = [["tok_embeddings"], ["layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]]
    assert named(stages) == stages


@pytest.mark.parametrize("stages,message", [
    ([["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "norm", "output"]],
     "parallelism.module_fqns_per_model_part: every module in exactly one stage (missing layers.3)"),
    ([["tok_embeddings", "layers.0", "layers.1"], ["layers.1", "layers.2", "layers.3", "norm", "output"]],
     "parallelism.module_fqns_per_model_part: every module in exactly one stage (in more than one stage: layers.1)"),
    ([["tok_embeddings", "layers.1", "layers.0"], ["layers.2", "layers.3", "norm", "output"]],
     "parallelism.module_fqns_per_model_part: the stages must take the modules in the model's order "
     "(tok_embeddings, layers.0, layers.1, layers.2, layers.3, norm, output)"),
    ([["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "layers.4", "norm", "output"]],
     "parallelism.module_fqns_per_model_part: no module 'layers.4'; the model has tok_embeddings, "
     "layers.0 .. layers.3, norm, output"),
    ([["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"], []],
     "parallelism.module_fqns_per_model_part: a stage with no module"),
    ([["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "norm", "output"]],
     "parallelism.pipeline_parallel_degree = 2: must divide the 3 pipeline stages (module_fqns_per_model_part or "
     "pipeline_parallel_layers_per_stage)"),
])
def test_a_named_split_that_loses_a_module_is_refused(stages, message):
    with pytest.raises(ConfigError) as err:
        named(stages)
    assert str(err.value) == message


def test_a_looped_schedule_needs_several_stages_per_rank():
    stages = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]
    with pytest.raises(ConfigError, match="^parallelism.pipeline_parallel_schedule = 'LoopedBFS' runs several "
                                          "stages per rank, but the split has 1; use 1F1B or GPipe, or at least 4"):
        named(stages, "LoopedBFS")


def test_dualpipev_is_refused_on_a_cpu_only():
    c = config("--parallelism.pipeline_parallel_schedule", "DualPipeV")
    with pytest.raises(ConfigError, match="needs a GPU"):
        check_pipeline(c, N_LAYERS, cuda=False)
    assert len(check_pipeline(c, N_LAYERS, cuda=True)) == 4  # a V: two stages per rank


def test_validation_runs_the_forward_actions_of_the_training_order():
    """Under an action-list schedule validation keeps the forward computations, their sends
    and receives and FSDP's unshard/reshard, in the training order; DualPipeV's overlapped
    step keeps its forward (the runs: the ZBVZeroBubble case of test_layouts.py)."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B, _Action

    from gamma_titan.training.validator import forward_actions

    order = [_Action.from_str(a) for a in
             ("0UNSHARD", "0F0", "0SEND_F0", "3RECV_F0", "3F0", "3B0", "0RECV_B0", "0I0", "0W0", "1SEND_B0",
              "0REDUCE_GRAD", "0RESHARD")]
    overlap = _Action(0, OVERLAP_F_B, None, (_Action.from_str("0F1"), _Action.from_str("3B0")))
    kept = forward_actions([*order[:5], overlap, *order[5:]])
    assert [str(a) for a in kept] == ["0UNSHARD", "0F0", "0SEND_F0", "3RECV_F0", "3F0", "0F1", "0RESHARD"]
    from torch.distributed.pipelining.schedules import _ComputationType

    if hasattr(_ComputationType, "WAIT_SEND_F"):  # torch 2.15: a send's wait is an action, checked at the end
        waits = [_Action.from_str(a) for a in ("0WAIT_SEND_F0", "1WAIT_SEND_B0")]
        assert [str(a) for a in forward_actions([*order[:3], *waits, *order[3:]])] == [
            "0UNSHARD", "0F0", "0SEND_F0", "0WAIT_SEND_F0", "3RECV_F0", "3F0", "0RESHARD"]
