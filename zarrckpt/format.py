"""The zarrckpt v1 format: what the ``zarr.json`` documents say (see ``spec/format.md``).

Builders produce the exact documents written; ``parse_*`` functions validate
documents read back (parse, don't trust) into typed records. No I/O here.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from . import dtypes
from .errors import FormatError, IncompleteCheckpointError, UnsupportedPlacementError, UnsupportedValueError
from .layout import Placement, placement_from_json, placement_to_json

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ArrayInfo",
    "RootInfo",
    "array_metadata",
    "inner_chunk_shape",
    "parse_array",
    "parse_root",
    "root_metadata",
]

FORMAT_NAME = "zarrckpt"
FORMAT_VERSION = "1.0"  # major.minor; readers refuse another major
ATTR = "zarrckpt"  # the attributes member holding zarrckpt's metadata
PACKS = ".packs"  # group of pack arrays; no escaped key starts with "." (spec §4)

# An array is stored with the sharding codec when its write unit (outer chunk)
# holds at least two inner chunks of this many bytes; inner chunks are what a
# resharded load reads, outer chunks what one rank writes.
DEFAULT_INNER_CHUNK_BYTES = 1 << 20

_BYTES_CODEC = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}


def new_save_id() -> str:
    """30 hex digits (120 random bits), so it travels as two int64 in one all-reduce."""
    return uuid.uuid4().hex[:30]


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def utc_from_us(us: int) -> str:
    return _dt.datetime.fromtimestamp(us / 1e6, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def compression_codec(compression: str | dict | None) -> dict | None:
    """``None`` | ``"zstd"`` | ``{"name": "zstd", "level": 3}`` -> a Zarr v3 codec."""
    if compression is None:
        return None
    if isinstance(compression, str):
        compression = {"name": compression}
    name = compression.get("name")
    if name == "zstd":
        return {"name": "zstd", "configuration": {"level": int(compression.get("level", 1)), "checksum": False}}
    if name == "gzip":
        return {"name": "gzip", "configuration": {"level": int(compression.get("level", 1))}}
    raise ValueError(f"unsupported compression {compression!r}; use None, 'zstd' or 'gzip'")


def inner_chunk_shape(chunk: tuple[int, ...], itemsize: int, target_bytes: int) -> tuple[int, ...] | None:
    """Inner chunk shape dividing ``chunk`` exactly, near ``target_bytes``, or None when the
    outer chunk is too small to be worth sharding.

    The longest divisible dim is cut by its smallest prime factor until the
    inner chunk fits: cuts spread over dims, so row and column reads both stay
    close to what they need.
    """
    if not chunk or math.prod(chunk) * itemsize < 2 * target_bytes:
        return None
    inner = list(chunk)
    while math.prod(inner) * itemsize > target_bytes:
        order = sorted(range(len(inner)), key=lambda d: -inner[d])
        for d in order:
            p = _smallest_factor(inner[d])
            if p:
                inner[d] //= p
                break
        else:
            break
    return tuple(inner) if tuple(inner) != tuple(chunk) else None


def _smallest_factor(n: int) -> int:
    if n < 2:
        return 0
    for p in range(2, math.isqrt(n) + 1):
        if n % p == 0:
            return p
    return n if n <= 64 else 0  # a large prime extent stays whole


def array_metadata(
    *,
    shape: tuple[int, ...],
    dtype: dtypes.DType,
    chunk_shape: tuple[int, ...],
    attrs: dict[str, Any],
    dimension_names: list[str],
    compression: dict | None = None,
    inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
) -> dict[str, Any]:
    """The ``zarr.json`` of one array."""
    inner_codecs = [_BYTES_CODEC] + ([compression] if compression else []) + [_CRC]
    inner = inner_chunk_shape(chunk_shape, dtype.numpy.itemsize, inner_chunk_bytes)
    if inner is None:
        codecs = inner_codecs
    else:
        codecs = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(inner),
                    "codecs": inner_codecs,
                    "index_codecs": [_BYTES_CODEC, _CRC],
                    "index_location": "end",
                },
            }
        ]
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtype.zarr,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": dtypes.fill_value(dtype),
        "codecs": codecs,
        "attributes": {ATTR: attrs},
        "dimension_names": dimension_names,
    }


def group_metadata(attrs: dict[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"zarr_format": 3, "node_type": "group"}
    if attrs is not None:
        doc["attributes"] = {ATTR: attrs}
    return doc


def root_metadata(
    *, state: str, save_id: str, world_size: int, created: str, writer: dict[str, str],
    tree: dict | None = None, num_arrays: int | None = None,
) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "state": state,
        "save_id": save_id,
        "world_size": world_size,
        "created": created,
        "writer": writer,
    }
    if state == "committed":
        attrs["committed"] = utc_now()
        attrs["num_arrays"] = num_arrays
        attrs["tree"] = tree
    return group_metadata(attrs)


def array_attrs(
    *, kind: str, save_id: str, dtype: dtypes.DType, mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None, placements: tuple[Placement, ...] | None = None,
    device_type: str | None = None,
) -> dict[str, Any]:
    attrs: dict[str, Any] = {"kind": kind, "save_id": save_id, "torch_dtype": dtype.torch}
    if kind == "dtensor":
        attrs["mesh"] = {
            "shape": list(mesh_shape or ()),
            "dim_names": list(mesh_dim_names) if mesh_dim_names else None,
            "device_type": device_type,
        }
        attrs["placements"] = [placement_to_json(p) for p in placements or ()]
    return attrs


# ---------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class RootInfo:
    version: str
    save_id: str
    world_size: int
    created: str
    writer: dict[str, Any]
    tree: dict[str, Any]
    raw: dict[str, Any]


@dataclass(frozen=True)
class ArrayInfo:
    key: str
    kind: str  # "tensor" | "dtensor" | "bytes" | "ndarray"
    shape: tuple[int, ...]
    dtype: dtypes.DType
    chunk_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...] | None
    mesh_dim_names: tuple[str, ...] | None
    placements: tuple[Placement, ...] | None
    metadata: dict[str, Any]


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise FormatError(f"{where}: {what}")


def parse_root(doc: dict[str, Any] | None, url: str) -> RootInfo:
    """Validate the root ``zarr.json``; raise if it is absent, foreign, newer or uncommitted."""
    from .errors import CheckpointNotFoundError

    if doc is None:
        raise CheckpointNotFoundError(f"no zarrckpt checkpoint at {url!r} (no zarr.json)")
    where = f"{url}/zarr.json"
    attrs = (doc.get("attributes") or {}).get(ATTR)
    if doc.get("node_type") != "group" or not isinstance(attrs, dict):
        raise CheckpointNotFoundError(
            f"{url!r} is a Zarr {doc.get('node_type', 'node')} but not a zarrckpt checkpoint "
            f"(no '{ATTR}' attributes)"
        )
    _need(attrs.get("format") == FORMAT_NAME, where, f"format is {attrs.get('format')!r}")
    version = attrs.get("version")
    _need(isinstance(version, str) and re.fullmatch(r"\d+\.\d+", version) is not None, where,
          f"bad version {version!r}")
    if version.split(".")[0] != FORMAT_VERSION.split(".")[0]:
        raise FormatError(
            f"{where}: format version {version} is not readable by this zarrckpt "
            f"(reads {FORMAT_VERSION.split('.')[0]}.x); upgrade zarrckpt"
        )
    state = attrs.get("state")
    if state == "pending":
        raise IncompleteCheckpointError(
            f"checkpoint {url!r} is incomplete: its save (id {attrs.get('save_id')}, started "
            f"{attrs.get('created')}) was interrupted or is still running; it was never committed"
        )
    _need(state == "committed", where, f"unknown state {state!r}")
    tree = attrs.get("tree")
    _need(isinstance(tree, dict) and "dict" in tree, where, "'tree' must be a dict node")
    ws = attrs.get("world_size")
    _need(isinstance(ws, int) and ws >= 1, where, f"bad world_size {ws!r}")
    return RootInfo(version, str(attrs.get("save_id")), ws, str(attrs.get("created")),
                    dict(attrs.get("writer") or {}), tree, doc)


def parse_packed(desc: Any, key: str) -> ArrayInfo:
    """Validate a ``packed`` tree node into the ArrayInfo of the leaf it holds."""
    where = f"packed leaf {key!r}"
    _need(isinstance(desc, dict), where, "descriptor must be an object")
    for name, typ in (("pack", str), ("offset", int), ("nbytes", int), ("kind", str),
                      ("data_type", str), ("shape", list)):
        _need(isinstance(desc.get(name), typ), where, f"'{name}' missing or not a {typ.__name__}")
    _need(desc["kind"] in ("tensor", "bytes", "ndarray"), where, f"unknown kind {desc['kind']!r}")
    try:
        dt = dtypes.by_zarr(desc["data_type"])
    except UnsupportedValueError as e:
        raise FormatError(f"{where}: {e}") from None
    shape = tuple(desc["shape"])
    _need(all(isinstance(s, int) and s >= 0 for s in shape), where, f"bad shape {shape}")
    _need(math.prod(shape) * dt.numpy.itemsize == desc["nbytes"], where, "nbytes disagrees with shape")
    return ArrayInfo(key, desc["kind"], shape, dt, shape, None, None, None, {})


def parse_array(doc: dict[str, Any] | None, key: str, save_id: str | None = None) -> ArrayInfo:
    from .errors import CorruptChunkError

    if doc is None:
        raise CorruptChunkError(f"array {key!r} is listed in the checkpoint but its zarr.json is missing")
    where = f"array {key!r}"
    _need(doc.get("zarr_format") == 3 and doc.get("node_type") == "array", where, "not a Zarr v3 array")
    shape = doc.get("shape")
    _need(isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape), where,
          f"bad shape {shape!r}")
    grid = doc.get("chunk_grid") or {}
    _need(grid.get("name") == "regular", where, "chunk grid must be regular")
    chunk = (grid.get("configuration") or {}).get("chunk_shape")
    _need(isinstance(chunk, list) and len(chunk) == len(shape), where, f"bad chunk_shape {chunk!r}")
    attrs = (doc.get("attributes") or {}).get(ATTR)
    _need(isinstance(attrs, dict), where, f"no '{ATTR}' attributes")
    if save_id is not None and attrs.get("save_id") != save_id:
        raise FormatError(
            f"{where} belongs to save {attrs.get('save_id')!r}, not to this checkpoint's save "
            f"{save_id!r}: the directory mixes two saves"
        )
    try:
        dt = dtypes.by_zarr(doc.get("data_type"))
    except UnsupportedValueError as e:
        raise FormatError(f"{where}: {e}") from None
    _need(attrs.get("torch_dtype") in (None, dt.torch), where,
          f"torch_dtype {attrs.get('torch_dtype')!r} disagrees with data_type {dt.zarr!r}")
    kind = attrs.get("kind")
    _need(kind in ("tensor", "dtensor", "bytes", "ndarray", "pack"), where, f"unknown kind {kind!r}")
    mesh_shape = names = placements = None
    if kind == "dtensor":
        mesh = attrs.get("mesh") or {}
        mesh_shape = tuple(mesh.get("shape") or ())
        names = tuple(mesh["dim_names"]) if mesh.get("dim_names") else None
        try:
            placements = tuple(placement_from_json(p) for p in attrs.get("placements") or ())
        except (UnsupportedPlacementError, KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{where}: bad placement ({e})") from None
        _need(len(placements) == len(mesh_shape), where, "placements and mesh shape differ in length")
    return ArrayInfo(key, kind, tuple(shape), dt, tuple(chunk), mesh_shape, names, placements, doc)
