"""The only module that calls ``torch.distributed``.

Every collective zarrckpt issues is one of the named functions below, so the
number and order of collectives in a save can be read off ``_save.py``.
Without an initialised process group everything degrades to a world of one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Group", "group"]


@dataclass
class Group:
    """A process group (or the single-process world) as zarrckpt uses it."""

    pg: Any
    rank: int
    size: int

    @property
    def active(self) -> bool:
        return self.pg is not None and self.size > 1

    def _device(self) -> torch.device:
        if self.pg is not None and dist.get_backend(self.pg) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_true(self, ok: bool) -> bool:
        """True iff ``ok`` on every rank (one all-reduce)."""
        if not self.active:
            return ok
        t = torch.tensor([0 if ok else 1], dtype=torch.int32, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return int(t.item()) == 0

    def check(self, ok: bool, payload: bytes, root_values: Sequence[int] = ()) -> tuple[bool, bool, list[int]]:
        """One all-reduce: (``ok`` on every rank, same ``payload`` on every rank, rank 0's
        ``root_values`` — non-negative ints below 2**62 — on every rank)."""
        if not self.active:
            return ok, True, list(root_values)
        h = int.from_bytes(hashlib.blake2b(payload, digest_size=7).digest(), "little")
        mine = list(root_values) if self.rank == 0 else [0] * len(root_values)
        t = torch.tensor([0 if ok else 1, h, -h, *mine], dtype=torch.int64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        vals = [int(v) for v in t.tolist()]
        return vals[0] == 0, vals[1] == -vals[2], vals[3:]

    def gather_to_root(self, obj: Any) -> list[Any] | None:
        """Objects of all ranks on rank 0 (None elsewhere). Only used on slow paths."""
        if not self.active:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.pg, 0), group=self.pg)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def group_rank(self, global_rank: int) -> int:
        if self.pg is None:
            return global_rank
        return dist.get_group_rank(self.pg, global_rank)

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
    ) -> None:
        """Point-to-point sends/receives (global ranks), matched per pair in list order."""
        if not sends and not recvs:
            return
        ops = [dist.P2POp(dist.isend, t, peer, group=self.pg) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=self.pg) for peer, t in recvs]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def new_side_group(self) -> Group:
        """A new group over the same ranks, for background work that must not share the
        caller's group (its collectives would interleave with the training loop's)."""
        if not self.active:
            return self
        ranks = [dist.get_global_rank(self.pg, r) for r in range(self.size)]
        pg = dist.new_group(ranks=ranks, backend="gloo")
        return Group(pg, self.rank, self.size)


def group(process_group: Any = None) -> Group:
    """The caller's group: the given one, else the default one, else a world of one."""
    if not dist.is_available() or not dist.is_initialized():
        return Group(None, 0, 1)
    pg = process_group if process_group is not None else dist.group.WORLD
    return Group(pg, dist.get_rank(pg), dist.get_world_size(pg))


def is_dtensor(obj: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(obj, DTensor)


def dtensor_info(t: Any) -> tuple[tuple[int, ...], tuple[str, ...] | None, tuple, Any, str, tuple[int, ...] | None]:
    """(mesh shape, dim names, zarrckpt placements, mesh rank tensor, device type, coordinate)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from .errors import UnsupportedPlacementError
    from .layout import Replicate as LReplicate
    from .layout import Shard as LShard
    from .layout import StridedShard as LStrided

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover
        _StridedShard = ()

    mesh = t.device_mesh
    out = []
    for p in t.placements:
        if _StridedShard and isinstance(p, _StridedShard):
            out.append(LStrided(p.dim, int(p.split_factor)))
        elif isinstance(p, Shard):
            out.append(LShard(p.dim))
        elif isinstance(p, Replicate):
            out.append(LReplicate())
        elif isinstance(p, Partial):
            raise UnsupportedPlacementError(
                f"placement Partial ({p!r}, a pending reduction) has no stored form: call "
                "dtensor.redistribute(placements=[Replicate() ...]) or .full_tensor() first"
            )
        else:
            raise UnsupportedPlacementError(f"unknown DTensor placement {p!r}")
    coord = mesh.get_coordinate()
    return (
        tuple(mesh.mesh.shape),
        tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        tuple(out),
        mesh.mesh,
        mesh.device_type,
        tuple(coord) if coord is not None else None,
    )
