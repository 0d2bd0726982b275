"""Tensor parallelism: which slice of the model a rank holds, and the collectives of a
sharded forward pass (Shoeybi et al., "Megatron-LM", 2019; vLLM / SGLang's layout).

Dimension letters: T tokens, N logit rows, E hidden, H query heads, K kv heads, D head
dim, F MLP width, V vocabulary, P = ``size`` ranks, r = ``rank``.

    layer               weight [out, in]   rank r holds                     after it
    qkv_proj (column)   [(H + 2K) D, E]    q heads r H/P .. ; its kv heads  -
    o_proj (row)        [E, H D]           the columns of its q heads       all-reduce
    gate_up (column)    [2F, E]            gate and up rows r F/P ..        -
    down_proj (row)     [E, F]             the columns r F/P ..             all-reduce
    embed (vocab)       [V, E]             rows r Vp .. (Vp = ceil(V / P))  mask, all-reduce
    lm_head (vocab)     [V, E]             rows r Vp ..                     all-gather [N, V]

KV heads: with K >= P each rank holds K / P of them; with K < P (P a multiple of K) each
holds one, the kv head of its q heads, replicated on P / K ranks (SmolLM2 at P = 3: 9 q
heads and 3 kv heads, one kv head per rank). Each rank's KV pool holds its own kv heads;
page ids are shared (one scheduler hands them out).

``TPShard`` is the arithmetic alone (weight loading, tests without a process group);
``TPGroup`` adds the process group: gloo on the CPU, NCCL on CUDA. The collectives work
in place or into preallocated outputs of fixed shapes, so CUDA graphs capture them
(NCCL all-reduce / all-gather are capturable). At ``size`` 1 there is no group and the
model never calls them.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["PeerPlacement", "RankPlacement", "TPGroup", "TPShard", "backend_for"]

logger = logging.getLogger("radixlm.parallel")
# The step channel (ZeroMQ) carries the waits between steps; a collective waits only for
# peers inside one step, so a long timeout just bounds a hang the launcher's watchdog ends.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class RankPlacement:
    """Where one model process sits: tensor parallel rank ``tp_rank`` of ``tp_size`` (the
    ranks of one data parallel replica meet at ``dist_init_addr``, host:port), its GPU
    (``gpu_id``, CUDA only) and the step channel (rank 0 binds one ipc address per other
    rank, each other rank connects to its own: ``step_addrs``)."""

    tp_rank: int = 0
    tp_size: int = 1
    dist_init_addr: str = ""
    gpu_id: int = 0
    step_addrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class PeerPlacement:
    """Where a replica's scheduler sits among the replicas (``--enable-peer-kv``): dp rank
    ``rank`` of ``size``; the replicas' process group meets at ``dist_init_addr``
    (host:port); ``inboxes[i]``: the ipc address where replica i's scheduler takes its
    peers' messages (it binds it, the others connect)."""

    rank: int
    size: int
    dist_init_addr: str
    inboxes: tuple[str, ...]


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size``: which heads, rows and columns it holds."""

    rank: int = 0
    size: int = 1

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's even share of ``n`` (ValueError if uneven)."""
        if n % self.size:
            raise ValueError(f"tensor parallel size {self.size} does not divide {what} ({n})")
        count = n // self.size
        return self.rank * count, count

    def q_heads(self, num_heads: int) -> tuple[int, int]:
        """(first, count) of this rank's query heads."""
        return self.split(num_heads, "the attention heads")

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of this rank's kv heads: K / P of them, or with K < P the one its
        q heads read (replicated on P / K ranks)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "the KV heads")
        if self.size % num_kv_heads:
            raise ValueError(f"tensor parallel size {self.size} is neither a divisor nor a multiple "
                             f"of the KV heads ({num_kv_heads})")
        first_q, _ = self.q_heads(num_heads)
        return first_q // (num_heads // num_kv_heads), 1

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, rows held, rows padded to Vp) of this rank's vocabulary slice: ranks hold
        Vp = ceil(V / P) rows each, the last ones fewer real rows (zero padding after)."""
        padded = -(-vocab_size // self.size)
        start = min(self.rank * padded, vocab_size)
        return start, min(padded, vocab_size - start), padded


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TPGroup(TPShard):
    """A ``TPShard`` with its process group (one per process: the default group)."""

    def __init__(self, rank: int, size: int, init_addr: str, device: torch.device) -> None:
        super().__init__(rank, size)
        object.__setattr__(self, "device", device)
        backend = backend_for(device)
        dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT, device_id=device if device.type == "cuda" else None)
        logger.info("tensor parallel rank %d of %d (%s, rendezvous %s)", rank, size, backend, init_addr)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """x [N, C] from every rank -> [N, total] (rank r's columns at r C; ``total`` <= P C
        trims the padding)."""
        n, c = x.shape
        out = torch.empty(self.size * n, c, dtype=x.dtype, device=x.device)  # [P N, C]
        _all_gather(out, x.contiguous())
        return out.view(self.size, n, c).permute(1, 0, 2).reshape(n, self.size * c)[:, :total]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (in place); returns it."""
        dist.broadcast(x, 0)
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV pool's pages: the same on all)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
