"""torch's side of the torch -> JAX -> torch round trip (tests/test_jax.py), run on a world
of 4 gloo ranks: DTensors on a (2, 2) mesh, saved, then loaded with other placements.
Kept apart from test_jax.py so the ranks never import jax."""

from __future__ import annotations

import numpy as np
import torch

import zarrckpt
from zarrckpt.format import dtypes

# key: (shape, dtype, save placements, load placements); None: a plain tensor
SPECS = {
    "model/w1": ((16, 12), torch.float32, "SS0:2,S0", "S1,R"),
    "model/w2": ((8, 12), torch.bfloat16, "S0,S1", "R,S0"),
    "model/b": ((12,), torch.float32, "R,S0", "R,R"),
    "model/fp8": ((8, 8), torch.float8_e4m3fn, "S1,R", "S0,S1"),
    "optim/state/model.w1/exp_avg": ((16, 12), torch.float32, "SS0:2,S0", "S0,R"),
    "optim/state/model.w1/step": ((), torch.float32, None, None),
    "buffers/count": ((4,), torch.int64, None, None),
}


def global_tensor(key: str) -> torch.Tensor:
    shape, dt, _, _ = SPECS[key]
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    x = torch.randn(shape, generator=g) * 50
    if dt == torch.int64:
        return (x * 1e9).to(torch.int64)  # values beyond 32 bits
    return x.to(dt)


def bits(t: torch.Tensor) -> np.ndarray:
    a = dtypes.to_numpy(t.detach().contiguous())
    return a.reshape(-1).view(np.uint8)


def _placements(spec: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in spec.split(","):
        if p == "R":
            out.append(Replicate())
        elif p.startswith("SS"):
            d, sf = p[2:].split(":")
            out.append(_StridedShard(int(d), split_factor=int(sf)))
        else:
            out.append(Shard(int(p[1:])))
    return out


def _state(which: int, zeros: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state: dict = {}
    for key, (_, _, save_pl, load_pl) in SPECS.items():
        t = global_tensor(key)
        if zeros:
            t = torch.zeros_like(t)
        spec = save_pl if which == 0 else load_pl
        if spec is None:
            leaf = t
        else:  # from local pieces: no collective (gloo cannot scatter fp8), _StridedShard too
            leaf = DTensor.from_local(_local(t, mesh, _placements(spec)), mesh, _placements(spec),
                                      shape=t.shape, stride=t.stride())
        node = state
        parts = key.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = leaf
    state["step"] = 0 if zeros else 10
    return state


def _local(t: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's piece, cut by torch's own placement split functions, left to right."""
    coord = mesh.get_coordinate()
    from torch.distributed.tensor import Replicate

    for i, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        t = p._split_tensor(t, mesh.size(i), with_padding=False)[0][coord[i]]
    return t.contiguous()


def save_torch(rank: int, world: int, path: str) -> bool:
    zarrckpt.save(_state(0, zeros=False), path, pack_bytes=0)
    return True


def load_torch_and_compare(rank: int, world: int, path: str) -> dict:
    """Load ``path`` into DTensors of the other placements; compare every bit of this
    rank's shards with the same pieces of the original global tensors."""
    from torch.distributed.tensor import DTensor

    state = _state(1, zeros=True)
    zarrckpt.load(state, path)
    out = {}
    for key in SPECS:
        node = state
        for p in key.split("/"):
            node = node[p]
        want = global_tensor(key)
        if isinstance(node, DTensor):  # this rank's piece (no all-gather: gloo has no fp8)
            got, want = node.to_local(), _local(want, node.device_mesh, node.placements)
        else:
            got = node
        out[key] = bool(np.array_equal(bits(got), bits(want))) and got.dtype == want.dtype
    out["step"] = state["step"] == 10
    return out
