"""Every dtype x mesh x grouping, saved from 4 gloo ranks and read back bit for bit
(issue 28, item 11: a float8_e5m2 DTensor on a 2x2 mesh saved with
``chunk_target_bytes=None`` could not be read).

One spawn of 4 ranks runs the whole matrix: for each layout (1-D mesh of 4 and 2x2 mesh,
Shard/Replicate combinations) and each grouping (``chunk_target_bytes`` default and None,
and None with tiny inner chunks), one checkpoint holds every dtype (all float8 kinds
torch has, bf16, fp16, fp32, bool, signed and unsigned ints) in two uneven shapes, as
random bit patterns (NaN payloads included). Each checkpoint is loaded into the layout
it was saved with and into the next layout (resharded), and on rank 0 into plain tensors
(``load_state_dict``, direct and TensorStore chunk reads) and through ``open().read``.
Every failure is collected with its case, so one run reports them all.
"""

from __future__ import annotations

import os
import traceback

import torch

import zarrckpt

LAYOUTS = {  # name: (mesh shape, placements)
    "4:S0": ((4,), "S0"),
    "4:S1": ((4,), "S1"),
    "4:R": ((4,), "R"),
    "2x2:S0,S1": ((2, 2), "S0,S1"),
    "2x2:S1,S0": ((2, 2), "S1,S0"),
    "2x2:S0,S0": ((2, 2), "S0,S0"),
    "2x2:S1,R": ((2, 2), "S1,R"),
    "2x2:R,S0": ((2, 2), "R,S0"),
    "2x2:R,R": ((2, 2), "R,R"),
}
GROUPINGS = {
    "ctb=default": {},
    "ctb=None": {"chunk_target_bytes": None},
    "ctb=None,inner=8B": {"chunk_target_bytes": None, "inner_chunk_bytes": 8},
}
SHAPES = ((8, 3), (13, 6))
DTYPES = [n for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                      "bfloat16", "float16", "float32", "bool", "int8", "int16", "int32", "int64",
                      "uint8", "uint16", "uint32", "uint64") if hasattr(torch, n)]


def global_state() -> dict[str, torch.Tensor]:
    """Random bit patterns of every dtype and shape (bool: 0 or 1)."""
    g = torch.Generator().manual_seed(28)
    out = {}
    for name in DTYPES:
        dt = getattr(torch, name)
        size = torch.empty((), dtype=dt).element_size()
        for shape in SHAPES:
            n = shape[0] * shape[1]
            raw = torch.randint(0, 2 if dt == torch.bool else 256, (n * size,), dtype=torch.uint8, generator=g)
            out[f"{name}_{shape[0]}x{shape[1]}"] = raw.view(dt).reshape(shape)
    return out


def placements(spec: str):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split(",")]


def local_of(t: torch.Tensor, mesh_shape, pls, coord) -> torch.Tensor:
    """The local shard as torch's own split functions cut it (not zarrckpt's layout code)."""
    from torch.distributed.tensor import Replicate

    for i, p in enumerate(pls):
        if not isinstance(p, Replicate):
            t = p._split_tensor(t, mesh_shape[i], with_padding=False)[0][coord[i]]
    return t.contiguous()


def dtensors(layout: str, zero: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh_shape, spec = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", mesh_shape)
    pls = placements(spec)
    out = {}
    for k, v in global_state().items():
        local = local_of(v, mesh_shape, pls, mesh.get_coordinate())
        out[k] = DTensor.from_local(torch.zeros_like(local) if zero else local, mesh, pls, run_check=False,
                                    shape=v.shape, stride=v.stride())
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_array(a, t: torch.Tensor) -> bool:
    """An ndarray (ml_dtypes for bf16/fp8) that holds exactly tensor ``t``'s bits."""
    from zarrckpt.format import dtypes

    want = dtypes.to_numpy(t)
    return a.dtype == want.dtype and a.shape == want.shape and a.tobytes() == want.tobytes()


def rank_matrix(rank: int, world: int, root: str) -> list[str]:
    """The whole matrix on this rank; returns the failed cases (empty: all passed)."""
    failures: list[str] = []
    glob = global_state()
    names = list(LAYOUTS)

    def attempt(case: str, fn) -> None:
        try:
            bad = fn()
        except Exception:  # noqa: BLE001 - collected, reported by the test
            failures.append(f"{case}: {traceback.format_exc(limit=-3)}")
            return
        if bad:
            failures.append(f"{case}: wrong values for {bad}")

    for gname, opts in GROUPINGS.items():
        for i, saved_as in enumerate(names):
            path = os.path.join(root, f"{gname}-{saved_as}".replace(":", "_").replace(",", "_").replace("=", "_"))
            case = f"[{gname}] saved as {saved_as}"
            try:
                zarrckpt.save(dtensors(saved_as, zero=False), path, **opts)
            except Exception:  # noqa: BLE001
                failures.append(f"{case}: save: {traceback.format_exc(limit=-3)}")
                continue
            for load_as in (saved_as, names[(i + 1) % len(names)]):
                def load(load_as=load_as):
                    target = dtensors(load_as, zero=True)
                    zarrckpt.load(target, path)
                    mesh_shape, spec = LAYOUTS[load_as]
                    return [k for k, t in target.items()
                            if not same_bits(t.to_local(), local_of(glob[k], mesh_shape, placements(spec),
                                                                     t.device_mesh.get_coordinate()))]
                attempt(f"{case}, loaded as {load_as}", load)
            if rank != 0:
                continue
            for chunk_io in ("direct", "tensorstore"):
                def plain(chunk_io=chunk_io):
                    sd = zarrckpt.load_state_dict(path, storage=zarrckpt.StorageOptions(chunk_io=chunk_io))
                    return [k for k, v in glob.items() if not same_bits(sd[k], v)]
                attempt(f"{case}, load_state_dict chunk_io={chunk_io}", plain)

            def via_open():
                ck = zarrckpt.open(path)
                return [k for k, v in glob.items() if not same_array(ck.read(k), v)]
            attempt(f"{case}, open().read", via_open)
    return failures


def test_dtype_mesh_grouping_matrix(tmp_path, clusters):
    results = clusters(4).run(rank_matrix, str(tmp_path), timeout=600)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, f"{len(failures)} failed cases:\n" + "\n".join(failures)


def test_as_strided_every_dtype():
    """The strided view the chunk reader scatters through, for every dtype of the table
    (NumPy's own as_strided refuses float8_e5m2: its type string reads back as '<f1')."""
    import numpy as np

    from zarrckpt.format import dtypes

    for row in dtypes._ROWS:
        base = np.zeros(24 * row.numpy.itemsize, np.uint8).view(row.numpy).reshape(4, 6)
        dst = base[:, 1:5]
        v = dtypes.as_strided(dst, (4, 2, 2), (dst.strides[0], 2 * dst.strides[1], dst.strides[1]))
        assert v.dtype == row.numpy and v.flags.writeable and np.shares_memory(v, base), row.zarr
        src = np.frombuffer(np.random.default_rng(0).bytes(16 * row.numpy.itemsize), row.numpy).reshape(4, 2, 2)
        np.copyto(v, src, casting="no")
        assert dst.tobytes() == src.reshape(4, 4).tobytes(), row.zarr
