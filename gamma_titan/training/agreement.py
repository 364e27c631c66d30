"""Decisions every rank must share, made once by rank 0 from what it reads in the run folder.

On a shared filesystem the ranks of different nodes can see the same folder differently
for a while (attribute caching on NFS or Lustre): one node may not yet see the checkpoint
another just wrote. A rank that decided for itself whether the run is finished, or which
checkpoint to resume from, could then leave the others waiting forever at the process
group's start or load another step than theirs. So rank 0 decides and the others take its
answer:

* before the process group exists (whether there is anything to do), through torchrun's
  rendezvous store, which every worker of a torchrun launch can reach
  (`rank_zero_decides`);
* once it exists (which checkpoint to load), by a broadcast over it
  (`broadcast_from_rank_zero`; GammaCheckpointManager uses it).
"""

from __future__ import annotations

import datetime
import os
from typing import Callable

#: How long the other ranks wait for rank 0's answer (its own pre-flight comes first).
WAIT_SECONDS = 600


def rank_zero_decides(name: str, decide: Callable[[], str]) -> str:
    """`decide()` run on rank 0 alone; every rank of this launch returns its answer. Outside
    torchrun (one process, or a launcher without its store) each process decides alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return decide()
    from torch.distributed import TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=WAIT_SECONDS))
    # one key per launch and per restart of it (torchrun's --max-restarts)
    key = (f"gamma_titan/{name}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if int(os.environ.get("RANK", "0")) == 0:
        answer = decide()
        store.set(key, answer)
        return answer
    return store.get(key).decode()


def broadcast_from_rank_zero(value: int) -> int:
    """Rank 0's `value` on every rank of the default process group (as is without one)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
