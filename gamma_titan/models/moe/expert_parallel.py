"""Expert parallelism that also runs on CPU.

TorchTitan's `ExpertParallel` (all-to-all token dispatch and combine around the routed
experts) permutes the received tokens into per-expert groups with a Triton kernel, which
needs a GPU. This subclass does the same dispatch and picks TorchTitan's own CPU
implementation of that permutation when the tokens live on the CPU; the combine step is
TorchTitan's unchanged.
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torchtitan.distributed.expert_parallel import ExpertParallel as TitanExpertParallel
from torchtitan.models.moe import utils as moe_utils
from torchtitan.models.moe.kernels import generate_permute_indices
from torchtitan.tools.utils import _round_up


def permute_by_local_expert(x: torch.Tensor, counts: torch.Tensor, ep_degree: int, n_local: int):
    """Reorder tokens received from every EP rank into one padded group per local expert.

    `counts` is (ep_degree * n_local,): tokens for local expert j from rank r at r*n_local+j.
    Returns (shape of x plus one zero row, permuted x, the permutation, padded group sizes).
    """
    align = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    max_len = _round_up(x.shape[0] + n_local * align, align)
    with torch.no_grad():
        indices, group_sizes, _ = generate_permute_indices(
            counts, n_local, ep_degree, max_len, align, use_cpu=x.device.type == "cpu"
        )
    x = torch.vstack((x, x.new_zeros((x.shape[-1],))))  # row -1: what padding slots read
    return x.shape, x[indices, :], indices, group_sizes


class ExpertParallel(TitanExpertParallel):
    def _token_dispatch(self, mod, inputs, device_mesh):
        routed_input, counts = inputs
        ep_degree = device_mesh.shape[0]
        n_local = counts.shape[0] // ep_degree
        group = device_mesh.get_group()
        with torch.no_grad():
            # How many tokens every rank sends to each of this rank's experts.
            received = torch.ops._c10d_functional.wait_tensor(all_to_all_single(counts, None, None, group=group))
            self.input_splits = counts.view(ep_degree, -1).sum(dim=1).cpu().tolist()
            self.output_splits = received.view(ep_degree, -1).sum(dim=1).cpu().tolist()
        routed_input = all_to_all_single_autograd(routed_input, self.output_splits, self.input_splits, group)
        self.input_shape, routed_input, self.permuted_indices, group_sizes = permute_by_local_expert(
            routed_input, received, ep_degree, n_local
        )
        return routed_input, group_sizes
