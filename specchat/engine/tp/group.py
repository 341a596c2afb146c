"""The ranks of one tensor-parallel model: a rendezvous store, a control group and a compute group.

Two torch.distributed process groups join the same N processes:
- *compute* runs the model's collectives (the all-reduce after each row-parallel linear, the logits' all-gather):
  NCCL on CUDA, gloo on the CPU;
- *control* carries rank 0's messages to the workers (each step's forward plan, KV page copies): always gloo, on
  the host, so that a worker waiting for the next step holds no GPU stream, and with no timeout worth the name (a
  worker may wait hours while the user reads).

The groups are process-group objects of their own, not torch.distributed's default group: nothing global is set,
so a process can hold more than one tensor-parallel engine (the tests hold a TP=2 engine beside a TP=1 one).
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) stays off in every rank: docs/gpu.md says why.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
HOST = "127.0.0.1"
STORE_TIMEOUT = datetime.timedelta(minutes=10)  # a rank waiting for the others to connect
IDLE_TIMEOUT = datetime.timedelta(days=30)  # a worker waiting for rank 0's next message
ROOT = 0


def keep_multicast_off() -> None:
    """Set the environment that keeps NVLink multicast off, in this process and the ones it starts."""
    os.environ.update(NO_MULTICAST_ENV)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: GPU r on CUDA, the host otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


@dataclass
class TPGroup:
    """This process's rank among `size`, and the collectives the sharded layers and the step loop use."""

    rank: int
    size: int
    device: torch.device
    control: dist.ProcessGroup
    compute: dist.ProcessGroup

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, device: torch.device) -> TPGroup:
        """Join the groups (every rank calls this at the same point; it returns when all have)."""
        keep_multicast_off()
        control = dist.ProcessGroupGloo(dist.PrefixStore("tp/control", store), rank, size, IDLE_TIMEOUT)
        compute_store = dist.PrefixStore("tp/compute", store)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            compute = dist.ProcessGroupNCCL(compute_store, rank, size)
        else:
            compute = dist.ProcessGroupGloo(compute_store, rank, size, STORE_TIMEOUT)
        return cls(rank, size, device, control, compute)

    # --- collectives of the sharded model -----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        self.compute.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape on all), in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.compute.allgather([parts], [x]).wait()
        return parts

    # --- rank 0's messages to the workers -----------------------------------------------------------------
    def send(self, message: object) -> None:
        """Rank 0: broadcast a picklable message (tensors in it on the host) to every worker."""
        data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        self.control.broadcast(torch.tensor([data.numel()], dtype=torch.long), ROOT).wait()
        self.control.broadcast(data, ROOT).wait()

    def receive(self) -> object:
        """A worker: wait for rank 0's next message."""
        size = torch.zeros(1, dtype=torch.long)
        self.control.broadcast(size, ROOT).wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        self.control.broadcast(data, ROOT).wait()
        return pickle.loads(data.numpy().tobytes())
