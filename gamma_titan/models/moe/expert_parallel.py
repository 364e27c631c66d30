"""Expert parallelism that also runs on CPU.

TorchTitan's `ExpertParallel` (all-to-all token dispatch and combine around the routed
experts) permutes the received tokens into per-expert groups with a Triton kernel, which
needs a GPU. This subclass does the same dispatch and picks TorchTitan's own CPU
implementation of that permutation when the tokens live on the CPU; the combine step is
TorchTitan's unchanged.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torchtitan.distributed.expert_parallel import ExpertParallel as TitanExpertParallel

from gamma_titan.models.common.moe import permute_by_local_expert


class ExpertParallel(TitanExpertParallel):
    def _token_dispatch(self, mod, inputs, device_mesh):
        routed_input, counts = inputs
        ep_degree = device_mesh.shape[0]
        n_local = counts.shape[0] // ep_degree
        group = device_mesh.get_group()
        with torch.no_grad():
            # How many tokens every rank sends to each of this rank's experts.
            received = torch.ops._c10d_functional.wait_tensor(all_to_all_single(counts, None, None, group=group))
            # The all-to-all's split sizes must be host numbers: both in one transfer, the
            # layer's only host sync (TorchTitan's dispatch has one blocking copy too).
            if is_fake(counts):  # a memory estimate (gamma_titan/estimate.py): tokens taken as evenly spread
                tokens = routed_input.shape[0]
                self.input_splits = [tokens // ep_degree + (r < tokens % ep_degree) for r in range(ep_degree)]
                self.output_splits = list(self.input_splits)
            else:
                splits = torch.stack([counts.view(ep_degree, -1).sum(dim=1), received.view(ep_degree, -1).sum(dim=1)])
                self.input_splits, self.output_splits = splits.cpu().tolist()
        routed_input = all_to_all_single_autograd(routed_input, self.output_splits, self.input_splits, group)
        self.input_shape, routed_input, self.permuted_indices, group_sizes = permute_by_local_expert(
            routed_input, received, ep_degree, n_local
        )
        return routed_input, group_sizes
