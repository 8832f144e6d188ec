"""Write the golden checkpoints of one format version: ``python tests/make_golden.py 1.3``.

Golden checkpoints are small checkpoints written by a released (or draft) version of the
format and committed under ``tests/golden/<version>/``; ``tests/test_golden.py`` checks that
every later zarrckpt still reads them bit for bit. Run this script once per format version,
with the zarrckpt of that version, and never again for a version whose files are committed:
the files are the record of what that version wrote.

What is covered: every leaf kind (tensor, DTensor, ndarray, bytes, bytearray, and values:
int, big int, float with NaN/inf, str, bool, None, list, tuple, named tuple, nested dicts,
int dict keys, empty containers, int/str subclasses), every data type of spec §5.2 (as
tensors and as ndarrays), 0-d and empty tensors, escaped keys, packed (the default) and
``pack_bytes=0``, zstd and gzip, the sharding codec (small ``inner_chunk_bytes``), and, saved
by 4 gloo ranks, DTensors ``Shard(0)`` (uneven, with an empty shard), ``[Shard(0), Shard(1)]``,
``[Shard(0), Shard(0)]`` (unaligned: boundary exchange), ``[_StridedShard, Shard]``,
``[Replicate, Shard]``, an edge shard whose trailing inner chunks lie wholly in its padding
(not stored, spec §5.3), and ranks that hold different keys (no packing).

From 1.1 on (``PLANS``) the set is smaller, to stay below 200 KB per version, and adds what the
version brought: ``bytesio`` leaves (packed and not), ShardedTensors (``ChunkShardingSpec``
on dim 0 and dim 1, uneven) and root ``metadata`` (1.1); consolidated metadata in every root,
no packing by default and grouped chunks (``chunk_target_bytes``, 256 MiB) for the DTensors
(1.2); the table of chunk positions in every root, ``digests.chunks`` (1.3, the saves of 1.2).
Options are passed explicitly, never taken from the writer's defaults. The writer of
1.2 writes 1.1 too: the checkpoints of 1.1 are 1.2 saves with the options of 1.1's writer
(``pack_bytes=65536`` by default, no grouped chunks), rewritten as 1.1 by
``tests/_v11.as_format_1_1`` (the root loses ``consolidated_metadata`` and says 1.1, digest
resealed), since 1.2 differs from 1.1 in what it writes only by that member.

``manifest.json`` records, for every checkpoint, the expected state as a typed JSON document
(:func:`describe`): containers with their keys, values exactly, and for array leaves their
kind, data type, shape and the SHA-256 of their little-endian C-order bytes.
"""

from __future__ import annotations

import enum
import hashlib
import io
import json
import math
import os
import sys
import tempfile
from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np

GOLDEN = Path(__file__).resolve().parent / "golden"

DATA_TYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bfloat16", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
]

Pair = namedtuple("Pair", "first second")


class Color(enum.IntEnum):
    RED = 1
    GREEN = 2


class Name(str):
    pass


# ------------------------------------------------------------------ describing a state


def leaf_bytes(leaf: Any) -> tuple[str, str, list[int], bytes]:
    """(leaf kind, data type, shape, little-endian C-order bytes) of an array leaf."""
    import torch

    from zarrckpt.format import dtypes

    if isinstance(leaf, torch.Tensor):
        if hasattr(leaf, "full_tensor"):
            leaf = leaf.full_tensor()
        t = leaf.detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return "tensor", dtypes.by_torch(t.dtype).zarr, list(t.shape), raw
    if isinstance(leaf, np.ndarray):
        a = leaf.astype(leaf.dtype.newbyteorder("<"), copy=False)  # keeps 0-d arrays 0-d
        return "ndarray", dtypes.by_numpy(a.dtype).zarr, list(a.shape), a.tobytes(order="C")
    if isinstance(leaf, (bytes, bytearray, memoryview)):
        b = bytes(leaf)
        return "bytes", "uint8", [len(b)], b
    if isinstance(leaf, io.BytesIO):
        b = leaf.getvalue()
        return "bytesio", "uint8", [len(b)], b
    raise TypeError(type(leaf))


def describe(obj: Any) -> Any:
    """A typed JSON description of a (saved or loaded) state: equal descriptions, equal states."""
    import torch

    if isinstance(obj, (torch.Tensor, np.ndarray, bytes, bytearray, memoryview, io.BytesIO)):
        kind, data_type, shape, raw = leaf_bytes(obj)
        return {"leaf": kind, "data_type": data_type, "shape": shape,
                "sha256": hashlib.sha256(raw).hexdigest()}
    if isinstance(obj, dict):
        return {"dict": [[k if isinstance(k, str) else int(k), describe(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"tuple": [describe(v) for v in obj]}
    if isinstance(obj, list):
        return {"list": [describe(v) for v in obj]}
    if obj is None:
        return {"none": None}
    if isinstance(obj, bool):
        return {"bool": obj}
    if isinstance(obj, int):
        return {"int": str(int(obj))}
    if isinstance(obj, float):
        return {"float": repr(float(obj))}
    if isinstance(obj, str):
        return {"str": str(obj)}
    if callable(getattr(obj, "state_dict", None)):
        return describe(obj.state_dict())
    raise TypeError(f"cannot describe {type(obj).__name__}")


# ------------------------------------------------------------------ the states


def typed_values(dt: str, n: int = 5) -> "Any":
    """A 1-D torch tensor of ``n`` distinct, exactly representable values of ``dt``."""
    import torch

    if dt == "bool":
        return torch.tensor([True, False, True, True, False][:n])
    if dt.startswith("complex"):
        return torch.tensor([complex(i, -i / 2) for i in range(n)], dtype=getattr(torch, dt))
    if dt == "float8_e8m0fnu":
        return torch.tensor([2.0 ** (i - 2) for i in range(n)]).to(torch.float8_e8m0fnu)
    if dt.startswith(("float", "bfloat")):
        return (torch.arange(n, dtype=torch.float32) / 4 - 0.5).to(getattr(torch, dt))
    if dt.startswith("uint"):
        top = {"uint8": 255, "uint16": 65535, "uint32": 2**32 - 1, "uint64": 2**63 - 1}[dt]
        return torch.tensor([0, 1, 2, top // 2, top][:n], dtype=torch.int64).to(getattr(torch, dt))
    info = np.iinfo(dt)
    return torch.tensor([info.min, -1, 0, 1, info.max][:n], dtype=getattr(torch, dt))


class Counter:
    """A Stateful leaf: stored as its state_dict()."""

    def __init__(self, n: int = 3) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n, "history": [1, 2, 3]}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def single_state() -> dict:
    import ml_dtypes
    import torch

    g = torch.Generator().manual_seed(7)
    state: dict[Any, Any] = {
        "model": {
            "big.weight": torch.randn(64, 48, generator=g),            # 12 KiB: never packed here
            "layer.weight": torch.randn(16, 8, generator=g),
            "layer/bias": torch.randn(8, generator=g).to(torch.bfloat16),
            "prime": torch.arange(67, dtype=torch.int64),                # prime extent > 64: never sharded
            "noncontig": torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),
        },
        "dtypes": {dt: typed_values(dt) for dt in DATA_TYPES},
        "dtypes_2d": {dt: typed_values(dt, 4).reshape(2, 2) for dt in ("bfloat16", "float8_e4m3fn", "complex128")},
        "ndarrays": {
            "int32": np.arange(6, dtype=np.int32).reshape(2, 3),
            "float64": np.linspace(0, 1, 5),
            "bool": np.array([True, False]),
            "bfloat16": np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16),
            "float8_e5m2": np.arange(4, dtype=np.float32).astype(ml_dtypes.float8_e5m2),
            "complex64": np.array([1 + 2j, -3j], dtype=np.complex64),
            "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
            "zero_d": np.array(3.5, dtype=np.float32),
        },
        "scalar": torch.tensor(2.5),                                     # 0-d
        "scalar_int": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.empty(0, 7),
        "empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        "optim": {
            "state": {
                0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(16, 8)},
                1: {"step": torch.tensor(1.0)},
            },
            "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.999), "name": None}],
        },
        "rng": b"\x00\xffbytes",
        "empty_bytes": b"",
        "barray": bytearray(b"\x01\x02\x03"),
        "values": {
            "int": 42, "neg": -3, "big": 2**70, "float": 0.1, "nan": float("nan"),
            "inf": float("inf"), "ninf": float("-inf"), "negzero": -0.0, "true": True, "false": False,
            "none": None, "str": "héllo ✓", "empty_str": "", "empty_dict": {}, "empty_list": [],
            "empty_tuple": (), "tuple": (1, "a", None), "list": [1.5, "x", None, [2, [3]]],
            "nested": {"a": {"b": {"c": 1}}}, "intkeys": {1: "one", 2: {"two": 2}},
            "named": Pair(1, 2.5), "intenum": Color.GREEN, "strsub": Name("sub"),
        },
        "plain": {"a": 1, "b": [1.5, "x", None], "c": {"d": True}},
        "mixed": [1, (2.5, float("nan")), {"k": torch.ones(1)}, b"\x01", [], {}],
        "stateful": Counter(),
        "unicode ü/é": torch.arange(3),
        "": torch.ones(1),
        ".hidden": torch.ones(1),
        "..": 2,
        "__reserved": torch.ones(2),
        "zarr.json": torch.ones(1),
        "50%": torch.ones(1),
        7: {"seven": torch.ones(1)},
        -1: "minus one",
    }
    return state


SINGLE = {
    "one_packed": {"pack_bytes": 1024},
    "one_unpacked": {"pack_bytes": 0},
    "one_zstd_sharded": {"compression": "zstd", "inner_chunk_bytes": 256, "pack_bytes": 0},
    "one_zstd_sharded_packed": {"compression": {"name": "zstd", "level": 3}, "inner_chunk_bytes": 256,
                                "pack_bytes": 1024},
    "one_gzip_packed": {"compression": {"name": "gzip", "level": 5}, "pack_bytes": 1024},
}


def dist_state(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh1 = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))

    def full(shape, dtype=torch.float32):
        n = math.prod(shape)
        return (torch.arange(n, dtype=torch.float64) * 0.25 - 3).to(dtype).reshape(shape)

    def strided(t, mesh):
        # [_StridedShard(0, split_factor=2), Shard(0)] on a 2x2 mesh (spec §5.7's example):
        # coordinates (0,0), (0,1), (1,0), (1,1) hold rows 0-1, 4-5, 2-3, 6-7
        dp, tp = mesh.get_coordinate()
        start = [[0, 4], [2, 6]][dp][tp]
        return DTensor.from_local(t[start:start + 2].clone(), mesh,
                                  [_StridedShard(0, split_factor=2), Shard(0)], shape=t.shape, stride=t.stride())

    def fp8(t, mesh):
        # gloo cannot scatter float8: distribute the bits, then view them back
        local = distribute_tensor(t.view(torch.uint8), mesh, [Shard(0)]).to_local().view(t.dtype)
        return DTensor.from_local(local, mesh, [Shard(0)], shape=t.shape, stride=t.stride())

    return {
        "shard0_uneven": distribute_tensor(full((5, 3)), mesh1, [Shard(0)]),        # 2,2,1,0 rows
        "shard1": distribute_tensor(full((3, 8), torch.bfloat16), mesh1, [Shard(1)]),
        "edge_padding": distribute_tensor(full((10, 2)), mesh1, [Shard(0)]),        # inner chunks in padding
        "shard_shard": distribute_tensor(full((6, 4)), mesh2, [Shard(0), Shard(1)]),
        "unaligned": distribute_tensor(full((9, 4)), mesh2, [Shard(0), Shard(0)]),
        "strided": strided(full((8, 2)), mesh2),
        "repl_shard": distribute_tensor(full((4, 6), torch.float16), mesh2, [Replicate(), Shard(1)]),
        "replicated": distribute_tensor(full((3,)), mesh1, [Replicate()]),
        "zero_d": distribute_tensor(torch.tensor(1.5), mesh1, [Replicate()]),
        "fp8": fp8(full((4, 4)).to(torch.float8_e4m3fn), mesh1),
        "plain": {"w": full((3, 3)), "b": torch.ones(2, dtype=torch.int8), "bytes": b"abc",
                  "nd": np.arange(4, dtype=np.uint16)},
        "step": 11,
        "lr": [0.5, float("inf")],
    }


def stages_state(rank: int, world: int) -> dict:
    import torch

    return {
        "shared": torch.arange(4, dtype=torch.float32),
        "stage": {str(rank): torch.full((2,), float(rank)), "n": rank if rank == 0 else 0},
        "step": 3,
    }


def _dist_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    import zarrckpt

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        zarrckpt.save(dist_state(rank, world), os.path.join(out, "four_ranks_dtensor"), inner_chunk_bytes=8)
        dist.barrier()
        zarrckpt.save(stages_state(rank, world), os.path.join(out, "four_ranks_stages"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ format 1.1 and later


GROUPED = 256 << 20  # chunk_target_bytes: the default of the 1.2 writer
METADATA = {"step": 7, "metrics": {"loss": 0.25, "tokens": 2**40}, "note": "golden ✓", "tags": ["a", None]}


def single_state_11() -> dict:
    """single_state plus the leaves 1.1 added: io.BytesIO (non-empty and empty)."""
    state = single_state()
    state["bytesio"] = io.BytesIO(b"\x00BytesIO\xff" * 3)
    state["empty_bytesio"] = io.BytesIO(b"")
    return state


def _sharded(world: int, rows: int, cols: int, dim: int) -> Any:
    """A ShardedTensor (ChunkShardingSpec on ``dim``) holding full((rows, cols))."""
    import torch
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_tensor.empty(spec, rows, cols)
    full = (torch.arange(rows * cols, dtype=torch.float64) * 0.25 - 3).to(torch.float32).reshape(rows, cols)
    for shard in st.local_shards():
        o, z = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(full[o[0]:o[0] + z[0], o[1]:o[1] + z[1]])
    return st


def dist_state_11(rank: int, world: int) -> dict:
    """dist_state plus ShardedTensors (uneven: 3, 3, 3, 1 rows; 3, 3, 3, 0 columns) and a BytesIO."""
    state = dist_state(rank, world)
    state["st_rows"] = _sharded(world, 10, 6, 0)
    state["st_cols"] = _sharded(world, 7, 9, 1)
    state["plain"]["bytesio"] = io.BytesIO(b"same on every rank")
    return state


def _full_dist_state_11(world: int) -> dict:
    import torch

    state = _full_dist_state(world)
    for name, (rows, cols) in (("st_rows", (10, 6)), ("st_cols", (7, 9))):
        state[name] = (torch.arange(rows * cols, dtype=torch.float64) * 0.25 - 3).to(torch.float32).reshape(rows, cols)
    state["plain"]["bytesio"] = io.BytesIO(b"same on every rank")
    return state


# per version: the writer's format, how to turn its output into this version, the saves
PLANS: dict[str, dict[str, Any]] = {
    "1.1": {
        "writer": "1.2", "rewrite": "as_format_1_1",
        "single": {"one_unpacked": {"pack_bytes": 0, "chunk_target_bytes": None},
                   "one_packed": {"pack_bytes": 65536, "chunk_target_bytes": None}},  # 1.1's defaults
        "dist": {"four_ranks_dtensor": {"inner_chunk_bytes": 8, "pack_bytes": 0, "chunk_target_bytes": None},
                 "four_ranks_stages": {"compression": "zstd", "pack_bytes": 0, "chunk_target_bytes": None}},
    },
    "1.2": {
        "writer": "1.2", "rewrite": None,
        "single": {"one_default": {"pack_bytes": 0, "chunk_target_bytes": GROUPED},  # 1.2's defaults
                   "one_packed": {"pack_bytes": 1024, "chunk_target_bytes": GROUPED}},  # deprecated, still read
        "dist": {"four_ranks_dtensor": {"inner_chunk_bytes": 8, "pack_bytes": 0, "chunk_target_bytes": GROUPED},
                 "four_ranks_stages": {"compression": {"name": "gzip", "level": 5}, "pack_bytes": 0,
                                       "chunk_target_bytes": GROUPED}},
    },
    # 1.3: the table of chunk positions (digests.chunks); the same saves as 1.2
    "1.3": {
        "writer": "1.3", "rewrite": None,
        "single": {"one_default": {"pack_bytes": 0, "chunk_target_bytes": GROUPED},
                   "one_packed": {"pack_bytes": 1024, "chunk_target_bytes": GROUPED}},
        "dist": {"four_ranks_dtensor": {"inner_chunk_bytes": 8, "pack_bytes": 0, "chunk_target_bytes": GROUPED},
                 "four_ranks_stages": {"compression": {"name": "gzip", "level": 5}, "pack_bytes": 0,
                                       "chunk_target_bytes": GROUPED}},
    },
}


def _dist_worker_plan(rank: int, world: int, init: str, out: str, version: str) -> None:
    import warnings

    import torch.distributed as dist

    import zarrckpt

    warnings.simplefilter("ignore")  # ShardedTensor is deprecated in torch; pack_bytes in zarrckpt
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        opts = PLANS[version]["dist"]
        zarrckpt.save(dist_state_11(rank, world), os.path.join(out, "four_ranks_dtensor"),
                      metadata=METADATA, **opts["four_ranks_dtensor"])
        dist.barrier()
        zarrckpt.save(stages_state(rank, world), os.path.join(out, "four_ranks_stages"), **opts["four_ranks_stages"])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main_plan(version: str, root: Path = GOLDEN) -> None:
    """The golden checkpoints of a version of PLANS (1.1 and later)."""
    import warnings

    import torch.multiprocessing as mp

    import zarrckpt
    from zarrckpt.format import documents as zformat

    plan = PLANS[version]
    if zformat.FORMAT_VERSION != plan["writer"]:
        sys.exit(f"this zarrckpt writes format {zformat.FORMAT_VERSION}, not {plan['writer']}")
    out = root / f"v{version}"
    if out.exists():
        sys.exit(f"{out} exists: golden files of a version are never rewritten")
    out.mkdir(parents=True)
    rewrite = None
    if plan["rewrite"]:
        import _v11

        rewrite = getattr(_v11, plan["rewrite"])
    manifest: dict[str, Any] = {"format_version": version, "zarrckpt": zarrckpt.__version__,
                                "written_as": plan["writer"] + (f", then {plan['rewrite']}" if rewrite else ""),
                                "checkpoints": {}}
    for name, options in plan["single"].items():
        state = single_state_11()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # pack_bytes > 0 is deprecated from 1.2
            zarrckpt.save(state, out / name, metadata=METADATA, **options)
        manifest["checkpoints"][name] = {"world_size": 1, "options": options, "metadata": METADATA,
                                         "expected": describe(single_state_11())}
    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_dist_worker_plan, args=(world, f"file://{tmp}/pg", str(out), version), nprocs=world, join=True)
    manifest["checkpoints"]["four_ranks_dtensor"] = {
        "world_size": world, "options": plan["dist"]["four_ranks_dtensor"], "metadata": METADATA,
        "expected": describe(_full_dist_state_11(world))}
    stages = {"shared": None, "stage": {}, "step": 3}
    for r in range(world):
        s = stages_state(r, world)
        stages["shared"] = s["shared"]
        stages["stage"].update(s["stage"])
    manifest["checkpoints"]["four_ranks_stages"] = {
        "world_size": world, "options": plan["dist"]["four_ranks_stages"], "expected": describe(stages)}
    if rewrite:
        for name in manifest["checkpoints"]:
            rewrite(out / name)
    (out / "manifest.json").write_text(dump_manifest(manifest), encoding="utf-8")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({total} bytes)")


def main(version: str, root: Path = GOLDEN) -> None:
    if version in PLANS:
        return main_plan(version, root)
    import torch.multiprocessing as mp

    import zarrckpt
    from zarrckpt.format import documents as zformat

    if zformat.FORMAT_VERSION != version:
        sys.exit(f"this zarrckpt writes format {zformat.FORMAT_VERSION}, not {version}")
    out = root / f"v{version}"
    if out.exists():
        sys.exit(f"{out} exists: golden files of a version are never rewritten")
    out.mkdir(parents=True)
    manifest: dict[str, Any] = {"format_version": version, "zarrckpt": zarrckpt.__version__, "checkpoints": {}}
    for name, options in SINGLE.items():
        state = single_state()
        zarrckpt.save(state, out / name, **options)
        manifest["checkpoints"][name] = {"world_size": 1, "options": options, "expected": describe(state)}

    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_dist_worker, args=(world, f"file://{tmp}/pg", str(out)), nprocs=world, join=True)
    manifest["checkpoints"]["four_ranks_dtensor"] = {
        "world_size": world, "options": {"inner_chunk_bytes": 8},
        "expected": describe(_full_dist_state(world))}
    stages = {"shared": None, "stage": {}, "step": 3}
    for r in range(world):
        s = stages_state(r, world)
        stages["shared"] = s["shared"]
        stages["stage"].update(s["stage"])
    manifest["checkpoints"]["four_ranks_stages"] = {
        "world_size": world, "options": {}, "expected": describe(stages)}
    (out / "manifest.json").write_text(dump_manifest(manifest), encoding="utf-8")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({total} bytes)")


def dump_manifest(m: dict) -> str:
    """Compact JSON, one line per checkpoint (diffs stay readable, the file small)."""
    head = json.dumps({k: v for k, v in m.items() if k != "checkpoints"})[:-1]
    items = [f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False, separators=(',', ':'))}"
             for k, v in m["checkpoints"].items()]
    return head + ', "checkpoints": {\n' + ",\n".join(items) + "\n}}\n"


def _full_dist_state(world: int) -> dict:
    """dist_state's DTensors as the full tensors they hold (computed without a process group)."""
    import torch

    def full(shape, dtype=torch.float32):
        n = math.prod(shape)
        return (torch.arange(n, dtype=torch.float64) * 0.25 - 3).to(dtype).reshape(shape)

    return {
        "shard0_uneven": full((5, 3)),
        "shard1": full((3, 8), torch.bfloat16),
        "edge_padding": full((10, 2)),
        "shard_shard": full((6, 4)),
        "unaligned": full((9, 4)),
        "strided": full((8, 2)),
        "repl_shard": full((4, 6), torch.float16),
        "replicated": full((3,)),
        "zero_d": torch.tensor(1.5),
        "fp8": full((4, 4)).to(torch.float8_e4m3fn),
        "plain": {"w": full((3, 3)), "b": torch.ones(2, dtype=torch.int8), "bytes": b"abc",
                  "nd": np.arange(4, dtype=np.uint16)},
        "step": 11,
        "lr": [0.5, float("inf")],
    }


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "1.3", Path(sys.argv[2]) if len(sys.argv) > 2 else GOLDEN)
