"""One job on several devices of a node: which rank this process is, and the few collectives the loop needs.

The agent starts one trainer per device with RANK, WORLD_SIZE and the rendezvous file (RENDEZVOUS_ENV) set. Every rank
holds the whole LoRA model and takes its share of each step's batch; summed gradients and target counts make
the step exactly the one a single process would take on the whole batch. Rank 0 alone speaks to the agent and
writes checkpoints and the adapter.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from schemas.events import RENDEZVOUS_ENV

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)  # rank 0 may tokenize a big dataset while the others wait


@dataclass
class World:
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str) -> "World":
        """This process's place in the job; joins the process group when there is more than one rank."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size == 1:
            return cls()
        rank = int(os.environ["RANK"])
        if device == "cuda":  # "cuda" is this rank's own device from here on
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        meet = f"file://{os.environ[RENDEZVOUS_ENV]}" if RENDEZVOUS_ENV in os.environ else "env://"  # env: torchrun's
        torch.distributed.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=meet,
            rank=rank,
            world_size=size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        return cls(rank, size)

    def sum(self, *values: float) -> list[float]:
        """Each value summed over the ranks (float64, so counts and losses add up exactly as one process's)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        torch.distributed.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on one (a stop asked of one rank stops all at the same step)."""
        return flag if self.size == 1 else self.sum(float(flag))[0] > 0

    def sum_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Add up the ranks' gradients in one flat buffer (a rank with no batch this step adds zeros)."""
        if self.size == 1:
            return
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n

    def same_start(self, params: Sequence[torch.Tensor]) -> None:
        """Every rank starts from rank 0's LoRA weights."""
        if self.size > 1:
            for p in params:
                torch.distributed.broadcast(p.data, 0)

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        if self.size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else "cpu"
