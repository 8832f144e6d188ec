"""The zarrckpt v1 format: what the ``zarr.json`` documents say (see ``spec/format.md``).

Builders produce the exact documents written (:func:`encode_document` gives their bytes);
``parse_*`` functions validate documents read back (parse, don't trust) into typed records:
every rule of the spec a reader relies on is checked here, and a broken one raises
:class:`~zarrckpt.errors.FormatError` (or its :class:`~zarrckpt.errors.IntegrityError`)
naming the key. No I/O here.

Integrity (spec §6.6): a committed root of format 1.1 records the SHA-256 of every array's
``zarr.json`` bytes and of its own bytes (with its own digest replaced by 64 zeros), so
that a changed byte anywhere in the metadata is an error, never a different value. From
1.3 it also records the CRC-32C each chunk (or inner chunk) must carry at its position
(``digests.chunks``), so that chunk bytes moved to another place are an error too.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import hashlib
import json
import math
import platform
import re
import sys
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from . import dtypes
from . import tree as ztree
from ..errors import (
    CheckpointNotFoundError,
    CorruptChunkError,
    FormatError,
    IncompleteCheckpointError,
    IntegrityError,
    UnsupportedPlacementError,
    UnsupportedValueError,
)
from .layout import Placement, placement_from_json, placement_to_json

__all__ = [
    "ARRAY_KINDS",
    "ATTR",
    "ArrayInfo",
    "BYTE_KINDS",
    "CONTENT_ALGORITHM",
    "DEFAULT_INNER_CHUNK_BYTES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_INDEX",
    "MAX_RANK",
    "PACKED_KINDS",
    "PACKS",
    "PLAIN_CODECS",
    "RootInfo",
    "array_attrs",
    "array_metadata",
    "check_array_digest",
    "check_metadata",
    "check_shape",
    "chunk_grid_shape",
    "chunk_key",
    "chunk_table",
    "compression_codec",
    "consolidated_metadata",
    "content_table",
    "decode_document",
    "encode_document",
    "group_metadata",
    "group_paths",
    "inner_chunk_shape",
    "is_save_id",
    "leftover_name",
    "lock_name",
    "new_save_id",
    "parse_array",
    "parse_chunk_table",
    "parse_leftover_name",
    "parse_packed",
    "parse_root",
    "parse_root_bytes",
    "parse_step_name",
    "root_attributes",
    "root_bytes",
    "root_digest",
    "root_metadata",
    "root_state",
    "staging_name",
    "step_name",
    "unit_grid",
    "unit_shape",
    "utc_from_us",
    "utc_now",
    "with_packed_nodes",
    "writer_versions",
]

FORMAT_NAME = "zarrckpt"
FORMAT_VERSION = "1.3"  # major.minor; readers refuse another major (spec §9)
ATTR = "zarrckpt"  # the attributes member holding zarrckpt's metadata
PACKS = ".packs"  # group of pack arrays; no escaped key starts with "." (spec §4)
DIGEST_ALGORITHM = "sha256"
ZERO_DIGEST = "0" * 64

ARRAY_KINDS = ("tensor", "dtensor", "sharded_tensor", "ndarray", "bytes", "bytesio", "pack")
PACKED_KINDS = ("tensor", "ndarray", "bytes", "bytesio")
BYTE_KINDS = ("bytes", "bytesio", "pack")  # 1-d uint8
MESH_KINDS = ("dtensor", "sharded_tensor")

MAX_RANK = 32  # dimensions of an array (TensorStore's limit)
MAX_INDEX = 2**63 - 1  # largest extent, element count and byte count

# An array is stored with the sharding codec when its write unit (outer chunk)
# holds at least two inner chunks of this many bytes; inner chunks are what a
# resharded load reads, outer chunks what one rank writes.
DEFAULT_INNER_CHUNK_BYTES = 1 << 20

_BYTES_CODEC = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}
# The codec chain of an uncompressed array without inner chunks (spec §5.4): its chunks are
# their raw little-endian bytes and a CRC-32C, which writers may encode themselves (C.5).
PLAIN_CODECS = [_BYTES_CODEC, _CRC]
_HEX64 = re.compile(r"[0-9a-f]{64}")
_SAVE_ID = re.compile(r"[0-9a-f]{16,64}")
_VERSION = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)")
_TIMESTAMP = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?Z")
_PACK_PATH = re.compile(r"\.packs/(0|[1-9][0-9]*)")
_HEX_FILL = re.compile(r"0x[0-9a-fA-F]+")


def new_save_id() -> str:
    """30 hex digits (120 random bits), so it travels as two int64 in one all-reduce."""
    return uuid.uuid4().hex[:30]


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def utc_from_us(us: int) -> str:
    return _dt.datetime.fromtimestamp(us / 1e6, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ------------------------------------------------------------------ bytes <-> documents


def encode_document(doc: Mapping[str, Any]) -> bytes:
    """The exact bytes written for a ``zarr.json`` (spec §3.1): compact JSON, ASCII only
    (other characters as ``\\uXXXX``), members in insertion order, no NaN/Infinity. Digests
    (§6.6) are over these bytes, so every ``zarr.json`` of a save is written with this."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode("ascii")


def root_bytes(root: Mapping[str, Any]) -> bytes:
    """:func:`encode_document` of a committed root, for its writer: the bytes
    :func:`root_metadata` already put together when ``root`` is the root it returned last
    (unchanged since: the writer publishes it as built), else encoded now."""
    last = _last_root  # one read: another thread's save may replace it
    return last[1] if root is last[0] else encode_document(root)


# the last committed root root_metadata built, and its bytes (see root_bytes)
_last_root: tuple[Any, bytes] = (None, b"")


class _Refused(Exception):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _Refused(f"member name {dup!r} appears twice in one object")
    return out


def _constant(name: str) -> Any:
    raise _Refused(f"the non-standard token {name} (JSON has no NaN or infinities)")


def _int(s: str) -> int:
    if len(s.lstrip("-")) > ztree.MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(s.lstrip('-'))} digits (at most {ztree.MAX_INT_DIGITS})")
    return int(s)


def _float(s: str) -> float:
    f = float(s)
    if not math.isfinite(f):
        raise _Refused(f"the number {s[:40]} is out of the range of a double")
    return f


MAX_NESTING = 102  # JSON levels of a document (spec §3.2): the deepest conforming root
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a candidate: the parse result decides
_SURROGATE = re.compile("[\ud800-\udfff]")


_BRACKETS = bytes(c for c in range(256) if c not in b'{}[]"')  # deleted by _nesting
_STEP = np.zeros(256, np.int8)
_STEP[list(b"{[")] = 1
_STEP[list(b"}]")] = -1


def _nesting(raw: bytes) -> int:
    """The depth of a JSON text (spec §3.2): the most objects and arrays open at once, outside
    strings (counted before parsing, so a deep document costs no recursion).

    Only bytes passes (a root document of thousands of arrays is megabytes): escaped
    backslashes, then escaped quotes are removed (in valid JSON a backslash escapes the
    one character after it), then everything but brackets and quotes, and what lies
    between quotes (an odd number of quotes before it) is string content."""
    bare = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _BRACKETS), np.uint8)
    if not bare.size:
        return 0
    outside = (np.cumsum(bare == ord('"'), dtype=np.int32) & 1) == 0
    return max(0, int(np.cumsum(np.where(outside, _STEP[bare], 0), dtype=np.int32).max()))


def _lone_surrogate(doc: Any) -> str | None:
    """The first string (member name or value) of a parsed document that holds a lone
    surrogate (only a ``\\uD800``-``\\uDFFF`` escape that is not part of a pair decodes to one)."""
    stack = [doc]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return v
        elif isinstance(v, dict):
            for k, x in v.items():
                if _SURROGATE.search(k):
                    return k
                stack.append(x)
        elif isinstance(v, list):
            stack.extend(v)
    return None


def decode_document(data: bytes, where: str) -> dict[str, Any]:
    """Parse a ``zarr.json`` strictly (spec §3.2): UTF-8, RFC 8259 JSON, an object, no
    duplicate member names, no NaN/Infinity tokens, integers of at most
    :data:`~zarrckpt.format.tree.MAX_INT_DIGITS` digits, finite numbers, every string
    Unicode scalar values (no lone surrogate escape), at most :data:`MAX_NESTING` levels deep.
    Any other input raises :class:`FormatError` naming ``where``."""
    data = bytes(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{where} is not UTF-8 ({e.reason} at byte {e.start})") from None
    depth = _nesting(data)
    if depth > MAX_NESTING:
        raise FormatError(f"{where} is nested too deeply: {depth} levels deep; a zarrckpt document has "
                          f"at most {MAX_NESTING} (spec §3.2)")
    try:
        doc = json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant,
                         parse_int=_int, parse_float=_float)
    except json.JSONDecodeError as e:
        raise FormatError(f"{where} is not valid JSON: {e}") from None
    except RecursionError:
        raise FormatError(f"{where} is nested too deeply to be a zarrckpt document") from None
    except _Refused as e:
        raise FormatError(f"{where}: {e}") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{where} must hold a JSON object, found {_json_type(doc)}")
    if _SURROGATE_ESCAPE.search(text):
        bad = _lone_surrogate(doc)
        if bad is not None:
            raise FormatError(f"{where}: the string {bad[:40]!r} holds a lone surrogate escape: not valid "
                              "Unicode (every string of a document is Unicode scalar values, spec §3.2)")
    return doc


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    return "an object" if isinstance(v, dict) else type(v).__name__


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def root_digest(data: bytes, claimed: str) -> str:
    """SHA-256 of root ``zarr.json`` bytes with the digest ``claimed`` (64 hex digits, which
    occur exactly once) replaced by 64 zeros (spec §6.6)."""
    return sha256_hex(data.replace(claimed.encode("ascii"), ZERO_DIGEST.encode("ascii"), 1))


# ------------------------------------------------------------------ building documents


def compression_codec(compression: str | dict | None) -> dict | None:
    """``None`` | ``"zstd"`` | ``{"name": "zstd", "level": 3}`` -> a Zarr v3 codec."""
    if compression is None:
        return None
    if isinstance(compression, str):
        compression = {"name": compression}
    if not isinstance(compression, dict):
        raise ValueError(f"unsupported compression {compression!r}; use None, 'zstd' or 'gzip'")
    name, level = compression.get("name"), compression.get("level", 1)
    if isinstance(level, bool) or not isinstance(level, int):
        raise ValueError(f"compression level must be an integer, not {level!r}")
    if name == "zstd":
        if not -131072 <= level <= 22:
            raise ValueError(f"zstd level {level} is outside -131072..22")
        return {"name": "zstd", "configuration": {"level": level, "checksum": False}}
    if name == "gzip":
        if not 0 <= level <= 9:
            raise ValueError(f"gzip level {level} is outside 0..9")
        return {"name": "gzip", "configuration": {"level": level}}
    raise ValueError(f"unsupported compression {compression!r}; use None, 'zstd' or 'gzip'")


MIN_INNER_CHUNK_BYTES = 64 << 10


def inner_chunk_shape(chunk: tuple[int, ...], itemsize: int, target_bytes: int) -> tuple[int, ...] | None:
    """Inner chunk shape dividing ``chunk`` exactly, or None when the outer chunk is too
    small to be worth sharding (spec Appendix C.2).

    A chunk of at least 4 x 64 KiB (2 x ``target_bytes`` if that is smaller) is cut into
    inner chunks of at most ``max(64 KiB, chunk / 4)`` and at most ``target_bytes``: at
    least 2 x 2 of them, so a resharded load that splits even a small chunk reads only the
    half it needs. Each cut goes to the dimension cut least so far (the larger extent on
    ties): every dimension is halved about as often as the others, so splits into 2, 4,
    ... along any dimension meet inner-chunk boundaries.
    """
    floor = min(target_bytes, MIN_INNER_CHUNK_BYTES)
    total = math.prod(chunk) * itemsize if chunk else 0
    if not chunk or total < min(2 * target_bytes, 4 * floor):
        return None
    goal = min(target_bytes, max(floor, total // 4))
    inner = list(chunk)
    while math.prod(inner) * itemsize > goal:
        order = sorted(range(len(inner)), key=lambda d: (chunk[d] // inner[d], -inner[d], d))
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


def check_shape(shape: tuple[int, ...], itemsize: int, where: str) -> None:
    """Writers: refuse what readers must refuse (spec §5.1 limits), before anything is written."""
    if len(shape) > MAX_RANK:
        raise UnsupportedValueError(f"{where}: {len(shape)} dimensions; at most {MAX_RANK} are stored")
    if math.prod(shape) * itemsize > MAX_INDEX:
        raise UnsupportedValueError(f"{where}: {math.prod(shape) * itemsize} bytes is over 2**63 - 1")


def array_metadata(
    *,
    shape: tuple[int, ...],
    dtype: dtypes.DType,
    chunk_shape: tuple[int, ...],
    attrs: dict[str, Any],
    dimension_names: list[str],
    compression: dict | None = None,
    inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
    cell_shape: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The ``zarr.json`` of one array. ``cell_shape``: a chunk groups whole shards of this
    shape (spec Appendix C.1); its inner chunks then lie within one shard (C.2)."""
    check_shape(tuple(shape), dtype.numpy.itemsize, "array")
    inner_codecs = [_BYTES_CODEC] + ([compression] if compression else []) + [_CRC]
    if cell_shape is not None and tuple(cell_shape) != tuple(chunk_shape):
        inner = inner_chunk_shape(tuple(cell_shape), dtype.numpy.itemsize, inner_chunk_bytes) or tuple(cell_shape)
    else:
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
                    "index_codecs": list(PLAIN_CODECS),
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


def chunk_key(index: Iterable[int]) -> str:
    """The key of a chunk (or shard) below its array's path (spec §5.1: the default chunk
    key encoding with separator ``/``): ``c/i/j/...``; ``c`` for a 0-d array."""
    return "/".join(["c", *map(str, index)])


_STEP_NAME = re.compile(r"step_([0-9]+)")


def unit_shape(doc: Mapping[str, Any]) -> tuple[int, ...]:
    """The shape of an array's *units* (spec §6.6): its inner chunks when sharded, else its
    chunks; from a valid array ``zarr.json``."""
    codecs = doc["codecs"]
    if len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
        return tuple(codecs[0]["configuration"]["chunk_shape"])
    return tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])


def unit_grid(doc: Mapping[str, Any]) -> tuple[int, ...]:
    """Units per dimension that overlap the array (spec §6.6): ``ceil(shape / unit)``; the
    table of positions lists them in C order (``()`` for a 0-d array: one unit)."""
    return tuple(-(-s // n) for s, n in zip(doc["shape"], unit_shape(doc)))


def chunk_table(doc: Mapping[str, Any], chunks: Mapping[tuple[int, ...], np.ndarray], path: str) -> str:
    """Writers: ``digests.chunks[path]`` (spec §6.6), the CRC-32C of every unit of the array
    in C order of the unit grid, little-endian uint32, base64; ``chunks`` maps every chunk
    index to the CRC-32Cs of its units that overlap the array (the chunk's part of the unit
    grid). ValueError if a unit has none (a chunk that was not written)."""
    grid = unit_grid(doc)
    per = tuple(c // n for c, n in zip(doc["chunk_grid"]["configuration"]["chunk_shape"], unit_shape(doc)))
    table = np.zeros(grid, "<u4")
    seen = np.zeros(grid, bool)
    for index, crcs in chunks.items():
        part = tuple(slice(i * p, min((i + 1) * p, g)) for i, p, g in zip(index, per, grid))
        table[part] = crcs
        seen[part] = True
    if not seen.all():
        missing = tuple(int(x) for x in np.argwhere(~seen)[0]) if grid else ()
        raise ValueError(f"array {path!r}: no CRC-32C was reported for its unit {list(missing)} "
                         f"(chunk {[u // p for u, p in zip(missing, per)]}): a chunk was not written")
    return base64.b64encode(table.tobytes()).decode("ascii")


CONTENT_ALGORITHM = "xxh3-128"  # digests.content (spec §6.6.2)


def chunk_grid_shape(doc: Mapping[str, Any]) -> tuple[int, ...]:
    """Chunks per dimension of an array's regular chunk grid (spec §5.3)."""
    return tuple(-(-s // c) for s, c in zip(doc["shape"], doc["chunk_grid"]["configuration"]["chunk_shape"]))


def content_table(doc: Mapping[str, Any], hashes: Mapping[tuple[int, ...], bytes]) -> str | None:
    """Writers: ``digests.content.chunks[path]`` (spec §6.6.2), the 16-byte content hash of
    every chunk of the chunk grid in C order, base64; None when a chunk has none (written
    where hashes are not computed: the array is left out of the member)."""
    out = bytearray()
    for index in np.ndindex(*chunk_grid_shape(doc)):
        h = hashes.get(tuple(int(i) for i in index))
        if h is None:
            return None
        out += h
    return base64.b64encode(bytes(out)).decode("ascii")


def parse_chunk_table(text: Any, doc: Mapping[str, Any], key: str) -> np.ndarray:
    """Readers: the table of positions of one array (spec §6.6) as a flat uint32 array in
    C order of its unit grid, checked: a base64 string (RFC 4648, padded, no line breaks)
    of exactly 4 bytes per unit of the array's (validated) metadata ``doc``."""
    where = f"array {key!r}: digests.chunks"
    if not isinstance(text, str):
        _fail(where, f"must be a base64 string, found {_json_type(text)}")
    try:
        raw = binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise FormatError(f"{where} is not a base64 string") from None
    count = math.prod(unit_grid(doc))
    if not len(raw) == 4 * count:
        _fail(where, f"holds {len(raw)} bytes, expected 4 per unit: {count} units of {list(unit_shape(doc))}")
    return np.frombuffer(raw, "<u4")


def step_name(step: int) -> str:
    """The directory of step ``step`` in a run of checkpoints (spec §7.7): ``step_`` and
    the step in decimal, zero-padded to 8 digits."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a step is an integer >= 0, not {step!r}")
    return f"step_{step:08d}"


def parse_step_name(name: str) -> int | None:
    """The step of a directory name in a run (spec §7.7: ``step_`` and decimal digits, any
    number of them), or None for any other name."""
    m = _STEP_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def _name_token(name: str) -> str:
    """``name`` as it appears in the names of a save's leftovers (spec §7.5): its UTF-8 bytes
    in lowercase hexadecimal, or, beyond 100 bytes, ``h`` and their SHA-256. Hex digits
    spell no word, so no leftover matches a trainer's checkpoint pattern (``step-N``,
    ``step_N``, ``checkpoint-N``, ``epoch=..-step=..``)."""
    if name.startswith(_HASHED):  # a name parse_leftover_name could only hash
        return "h" + name[len(_HASHED):]
    raw = name.encode("utf-8", "surrogateescape")
    return raw.hex() if len(raw) <= _MAX_HEX_NAME else "h" + hashlib.sha256(raw).hexdigest()


_MAX_HEX_NAME = 100  # bytes: with zarrckpt's 30-digit save ids a lock file's name is then at most 246 bytes
_HASHED = "/sha256/"  # what parse_leftover_name gives for a hashed name (no real name holds "/")


def staging_name(name: str, save_id: str) -> str:
    """The directory a save of ``save_id`` to the directory ``name`` writes into, next to
    it (file systems, spec §7.3, §7.5); ``-old`` is appended to a replaced checkpoint moved
    aside."""
    return f".zarrckpt-{save_id}.{_name_token(name)}"


def lock_name(name: str, save_id: str) -> str:
    """The lock file that says the save ``save_id`` of ``name`` is alive (spec §7.5)."""
    return f".zarrckpt-{save_id}.{_name_token(name)}.lock"


def leftover_name(name: str) -> str:
    """What :func:`parse_leftover_name` reports as the name of ``name``'s leftovers: the
    name itself, or, for names too long to spell in a leftover's name, a stand-in."""
    token = _name_token(name)
    return _HASHED + token[1:] if token.startswith("h") else name


_STAGING_NAME = re.compile(r"\.zarrckpt-(?P<id>[0-9a-f]{16,64})\.(?P<tok>h[0-9a-f]{64}|(?:[0-9a-f]{2})+)(?:-old)?")
_LOCK_NAME = re.compile(r"\.zarrckpt-(?P<id>[0-9a-f]{16,64})\.(?P<tok>h[0-9a-f]{64}|(?:[0-9a-f]{2})+)\.lock")
# the names of zarrckpt 0.1 (format 1.1 drafts): .<name>.zarrckpt-<id>[-old|.lock]; they embed
# the name as it is, so a step-15's leftover matched a trainer's step pattern
_OLD_STAGING_NAME = re.compile(r"\.(?P<name>.+)\.zarrckpt-(?P<id>[0-9a-f]{16,64})(?:-old)?", re.DOTALL)
_OLD_LOCK_NAME = re.compile(r"\.(?P<name>.+)\.zarrckpt-(?P<id>[0-9a-f]{16,64})\.lock", re.DOTALL)


def _token_name(tok: str) -> str | None:
    if tok.startswith("h"):
        return _HASHED + tok[1:]
    try:
        return bytes.fromhex(tok).decode("utf-8", "surrogateescape")
    except ValueError:
        return None


def parse_leftover_name(entry: str) -> tuple[str, str, str] | None:
    """``(kind, name, save id)`` of a directory entry that a save of ``name`` makes next
    to it (spec §7.5): kind ``"lock"`` (its lock file) or ``"directory"`` (its staging
    directory, or a replaced checkpoint moved aside); None for any other entry. Names of
    zarrckpt 0.1's leftovers (``.<name>.zarrckpt-<id>``) are recognized too. ``name`` is
    :func:`leftover_name` of the location's name."""
    for kind, new, old in (("lock", _LOCK_NAME, _OLD_LOCK_NAME), ("directory", _STAGING_NAME, _OLD_STAGING_NAME)):
        m = new.fullmatch(entry)
        if m:
            name = _token_name(m["tok"])
            if name is not None:
                return kind, name, m["id"]
        m = old.fullmatch(entry)
        if m and not m["name"].startswith("zarrckpt-"):
            return kind, m["name"], m["id"]
    return None


def is_save_id(value: Any) -> bool:
    """A save id as roots record it (spec §6.1): 16 to 64 lower-case hex digits."""
    return isinstance(value, str) and _SAVE_ID.fullmatch(value) is not None


def root_attributes(data: bytes | None) -> dict[str, Any] | None:
    """The ``zarrckpt`` attributes of a root ``zarr.json``'s bytes, read leniently (no digest
    or schema check: pending and damaged roots too), or None when absent, not JSON, not
    an object or without them. For claiming, listing, retention and reports; never for
    loading, which parses the root strictly (:func:`parse_root_bytes`)."""
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    attrs = attrs.get(ATTR) if isinstance(attrs, dict) else None
    return attrs if isinstance(attrs, dict) else None


def root_state(data: bytes | None) -> tuple[str, dict[str, Any]]:
    """What the bytes of a root ``zarr.json`` say about a location, read leniently
    (:func:`root_attributes`): ``("absent", {})`` no document; ``("committed" | "pending",
    attrs)`` a zarrckpt root (any ``state`` other than committed counts as pending, spec
    §7.1); ``("foreign", {})`` anything else."""
    if data is None:
        return "absent", {}
    attrs = root_attributes(data)
    if attrs is None or attrs.get("format") != FORMAT_NAME:
        return "foreign", {}
    return ("committed" if attrs.get("state") == "committed" else "pending"), attrs


def group_metadata(attrs: dict[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"zarr_format": 3, "node_type": "group"}
    if attrs is not None:
        doc["attributes"] = {ATTR: attrs}
    return doc


_GROUP_BYTES = encode_document(group_metadata())  # an intermediate group's zarr.json


def group_paths(keys: Iterable[str]) -> list[str]:
    """The intermediate groups of the arrays at ``keys`` (spec §5.1): every proper prefix
    of a key, sorted; each holds a group ``zarr.json``."""
    return sorted({key.rsplit("/", i)[0] for key in keys for i in range(1, key.count("/") + 1)})


def consolidated_metadata(array_docs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The root's ``consolidated_metadata`` (spec §6.7; zarr-python's form): every node
    below the root by its path, sorted (the intermediate groups, and the arrays ``array_docs``
    with their documents exactly as written), so that one read of the root lists and opens
    the whole hierarchy."""
    nodes: dict[str, Any] = {g: group_metadata() for g in group_paths(array_docs)}
    nodes.update((path, dict(doc)) for path, doc in array_docs.items())
    return {"kind": "inline", "must_understand": False, "metadata": dict(sorted(nodes.items()))}


def with_packed_nodes(tree: dict, nodes: Mapping[str, dict]) -> dict:
    """The ``tree`` document (spec §6.2) with the ``{"array": key}`` leaves of packed keys
    swapped for their ``{"packed": ...}`` nodes (``nodes``: key -> node, spec §6.5)."""
    if not nodes:
        return tree
    ((kind, body),) = tree.items()
    if kind == "array":
        return nodes.get(body, tree)
    if kind == "dict":
        return {"dict": [[k, with_packed_nodes(v, nodes)] for k, v in body]}
    if kind in ("list", "tuple"):
        return {kind: [with_packed_nodes(v, nodes) for v in body]}
    return tree


def writer_versions(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The root's ``writer`` object (spec §6.1): versions of the software that wrote the
    checkpoint. torch is named only when it is imported (torch-free writers do not load
    it); ``extra`` adds the caller's own (``{"jax": ...}``)."""
    from importlib.metadata import PackageNotFoundError, version

    from .._version import __version__

    out = {"zarrckpt": __version__}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = str(torch.__version__)
    try:
        out["tensorstore"] = version("tensorstore")
    except PackageNotFoundError:  # pragma: no cover
        out["tensorstore"] = "unknown"
    out["python"] = platform.python_version()
    out.update(extra or {})
    return out


def root_metadata(
    *, state: str, save_id: str, world_size: int, created: str, writer: dict[str, str],
    tree: dict | None = None, num_arrays: int | None = None,
    array_docs: Mapping[str, Mapping[str, Any]] | None = None,
    metadata: Mapping[str, Any] | None = None,
    chunk_crcs: Mapping[str, Mapping[tuple[int, ...], np.ndarray]] | None = None,
    content_hashes: Mapping[str, Mapping[tuple[int, ...], bytes]] | None = None,
) -> dict[str, Any]:
    """The root ``zarr.json`` document (spec §6.1), pending or committed.

    ``chunk_crcs``: for a committed root, ``{array path: {chunk index: CRC-32Cs}}`` of
    every chunk of every array, each an array of the chunk's units that overlap the array
    (spec §6.6: a whole chunk, or its inner chunks in C order); the root records them as
    ``digests.chunks`` and says version 1.3. Without them (writers that do not collect the
    CRCs yet) a committed root with ``array_docs`` says version 1.2, which has no such table.

    ``metadata``: the caller's own JSON object (step, metrics ...), stored in the committed
    root as ``metadata`` (§6.1) and covered by its digest; checked like tree values (§6.2).

    ``array_docs``: for a committed root, ``{array path: array zarr.json document}`` of
    every array of the checkpoint, pack arrays included, each written to storage as
    exactly :func:`encode_document` of it. The root then records their SHA-256 and its
    own (§6.6); write it as exactly ``encode_document(returned document)``.

    Without ``array_docs`` a committed root carries no digests and says version 1.0 (the
    version whose roots had none); this path exists for callers not yet passing
    ``array_docs`` and will be removed.
    """
    attrs: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "state": state,
        "save_id": save_id,
        "world_size": world_size,
        "created": created,
        "writer": writer,
    }
    if state != "committed":
        return group_metadata(attrs)
    if array_docs is not None:
        if num_arrays is not None and num_arrays != len(array_docs):
            raise ValueError(f"num_arrays {num_arrays} != {len(array_docs)} array documents")
        num_arrays = len(array_docs)
    attrs["committed"] = utc_now()
    attrs["num_arrays"] = num_arrays
    attrs["tree"] = tree
    if metadata is not None:
        attrs["metadata"] = check_metadata(metadata)
    if array_docs is None:
        attrs["version"] = "1.0"
        return group_metadata(attrs)
    encoded = {path: encode_document(array_docs[path]) for path in array_docs}  # once (~15 ms / 1,000)
    attrs["digests"] = {
        "algorithm": DIGEST_ALGORITHM,
        "root": ZERO_DIGEST,
        "arrays": {path: sha256_hex(encoded[path]) for path in sorted(array_docs)},
    }
    if chunk_crcs is None:
        attrs["version"] = "1.2"  # no table of chunk positions (spec §9: the version before it)
    else:
        attrs["digests"]["chunks"] = {path: chunk_table(array_docs[path], chunk_crcs.get(path, {}), path)
                                      for path in sorted(array_docs)}
        if content_hashes is not None:  # spec §6.6.2: only arrays with a hash for every chunk
            tables = {path: content_table(array_docs[path], content_hashes.get(path, {}))
                      for path in sorted(array_docs)}
            attrs["digests"]["content"] = {"algorithm": CONTENT_ALGORITHM,
                                           "chunks": {p: t for p, t in tables.items() if t is not None}}
    doc = group_metadata(attrs)
    doc["consolidated_metadata"] = consolidated_metadata(array_docs)
    # encode_document(doc), put together from the documents' encodings above (compact JSON
    # is the concatenation of its members'), then the root digest put in place of the zeros
    head = encode_document(group_metadata(attrs))
    nodes = [json.dumps(path).encode("ascii") + b":" + (encoded[path] if path in encoded else _GROUP_BYTES)
             for path in doc["consolidated_metadata"]["metadata"]]
    data = (head[:-1] + b',"consolidated_metadata":{"kind":"inline","must_understand":false,"metadata":{'
            + b",".join(nodes) + b"}}}")
    digest = sha256_hex(data)
    attrs["digests"]["root"] = digest
    zeros = f'"digests":{{"algorithm":"{DIGEST_ALGORITHM}","root":"{ZERO_DIGEST}"'.encode("ascii")
    if head.count(zeros) == 1:  # no user value spells the same: the one is the root's own
        head = head.replace(zeros, zeros.replace(ZERO_DIGEST.encode("ascii"), digest.encode("ascii")))
        global _last_root
        _last_root = (doc, head[:-1] + data[len(head) - 1:])
    return doc


def check_metadata(metadata: Any) -> dict[str, Any]:
    """Writers: the user ``metadata`` object as stored, or UnsupportedValueError (spec §6.1)."""
    if not isinstance(metadata, Mapping):
        raise UnsupportedValueError(f"metadata must be a JSON object, not {type(metadata).__name__}")
    try:
        node = ztree.encode_tree({"metadata": dict(metadata)}, lambda x: False)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"metadata: {e}") from None
    ((_, value),) = node["dict"]
    if "json" not in value:
        raise UnsupportedValueError("metadata must be plain JSON: string keys, finite numbers, str, "
                                    "bool, None, lists and objects of them")
    return value["json"]


def array_attrs(
    *, kind: str, save_id: str, dtype: dtypes.DType, mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None, placements: tuple[Placement, ...] | None = None,
    device_type: str | None = None,
) -> dict[str, Any]:
    """``attributes.zarrckpt`` of an array (spec §5.6). ``dtensor`` and ``sharded_tensor``
    record the save-time mesh and placements."""
    if kind not in ARRAY_KINDS:
        raise ValueError(f"unknown array kind {kind!r}")
    attrs: dict[str, Any] = {"kind": kind, "save_id": save_id, "torch_dtype": dtype.torch}
    if kind in MESH_KINDS:
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
    leaves: tuple = ()  # (key path, key, leaf node) in stored order (tree.parse_tree)
    arrays: frozenset = frozenset()  # array paths: array nodes and the packs named
    array_digests: Mapping[str, str] | None = None  # array path -> SHA-256 (1.1 and later)
    metadata: dict[str, Any] | None = None  # the caller's metadata object (1.1 and later)
    consolidated: Mapping[str, Any] | None = None  # node path -> its zarr.json (1.2 and later)
    chunk_tables: Mapping[str, str] | None = None  # array path -> digests.chunks entry (1.3 and later)


@dataclass(frozen=True)
class ArrayInfo:
    key: str
    kind: str  # one of ARRAY_KINDS
    shape: tuple[int, ...]
    dtype: dtypes.DType
    chunk_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...] | None
    mesh_dim_names: tuple[str, ...] | None
    placements: tuple[Placement, ...] | None
    metadata: dict[str, Any]  # the validated zarr.json, reduced to the members of spec §5.1
    inner_chunk_shape: tuple[int, ...] | None = field(default=None)


def _lists_the_arrays(member: dict, paths: set, where: str, name: str, each: str) -> None:
    """IntegrityError unless the keys of ``member`` (a per-array member of ``digests``) are
    exactly the arrays of the tree, naming up to five on either side."""
    if set(member) != paths:
        extra, missing = sorted(set(member) - paths), sorted(paths - set(member))
        raise IntegrityError(
            f"{where}: {name} does not list exactly the arrays of the tree"
            + (f"; not in the tree: {extra[:5]}" if extra else "")
            + (f"; without {each}: {missing[:5]}" if missing else ""))


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise FormatError(f"{where}: {what}")


def _fail(where: str, what: str) -> NoReturn:
    """The refusal of :func:`_need`, for messages built only when a check fails (checks
    run once per array of every load: formatting every message cost ~1 µs each)."""
    raise FormatError(f"{where}: {what}")


def _is_int(v: Any, lo: int = 0, hi: int = MAX_INDEX) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _int_list(v: Any, lo: int, max_len: int = MAX_RANK) -> bool:
    return isinstance(v, list) and len(v) <= max_len and all(_is_int(x, lo) for x in v)


def _timestamp(v: Any) -> bool:
    if not (isinstance(v, str) and _TIMESTAMP.fullmatch(v)):
        return False
    try:
        _dt.datetime.strptime(v[:19], "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return False
    return True


def parse_root_bytes(data: bytes | None, url: str) -> RootInfo:
    """Parse and verify the bytes of a root ``zarr.json`` (None: absent)."""
    if data is None:
        raise CheckpointNotFoundError(f"no zarrckpt checkpoint at {url!r} (no zarr.json)")
    return parse_root(decode_document(data, f"{url}/zarr.json"), url, raw=data)


def parse_root(doc: dict[str, Any] | None, url: str, raw: bytes | None = None) -> RootInfo:
    """Validate the root ``zarr.json``; raise if it is absent, foreign, newer, uncommitted or
    damaged. ``raw``: the document's bytes, to verify its digest (spec §6.6); without them
    (a document built in memory) the digest is not checked."""
    if doc is None:
        raise CheckpointNotFoundError(f"no zarrckpt checkpoint at {url!r} (no zarr.json)")
    where = f"{url}/zarr.json"
    if not isinstance(doc, dict):
        _fail(where, f"must be a JSON object, found {_json_type(doc)}")
    if not (doc.get("zarr_format") == 3 and _is_int(doc.get("zarr_format"))):
        _fail(where, f"zarr_format is {doc.get('zarr_format')!r}, not 3")
    node_type = doc.get("node_type")
    attributes = doc.get("attributes", {})
    if not isinstance(attributes, dict):
        _fail(where, f"'attributes' must be an object, found {_json_type(attributes)}")
    if node_type != "group" or ATTR not in attributes:
        raise CheckpointNotFoundError(
            f"{url!r} is a Zarr {node_type if isinstance(node_type, str) else 'node'} but not a "
            f"zarrckpt checkpoint (no '{ATTR}' attributes)")
    attrs = attributes[ATTR]
    if not isinstance(attrs, dict):
        _fail(where, f"attributes.{ATTR} must be an object, found {_json_type(attrs)}")
    if not attrs.get("format") == FORMAT_NAME:
        _fail(where, f"format is {attrs.get('format')!r}, not {FORMAT_NAME!r}")
    version = attrs.get("version")
    if not (isinstance(version, str) and _VERSION.fullmatch(version) is not None):
        _fail(where, f"version must be \"major.minor\", found {version!r}")
    major, minor = (int(x) for x in version.split("."))
    if major != int(FORMAT_VERSION.split(".")[0]):
        raise FormatError(
            f"{where}: format version {version} is not readable by this zarrckpt "
            f"(reads {FORMAT_VERSION.split('.')[0]}.x); upgrade zarrckpt")
    state = attrs.get("state")
    if state == "pending":
        raise IncompleteCheckpointError(
            f"checkpoint {url!r} is incomplete: its save (id {attrs.get('save_id')}, started "
            f"{attrs.get('created')}) was interrupted or is still running; it was never committed")
    if state != "committed":
        _fail(where, f"unknown state {state!r}")
    digests = attrs.get("digests")
    if digests is not None or minor >= 1:
        if not isinstance(digests, dict):
            _fail(where, f"a committed root of version {version} must record 'digests' (spec §6.6)")
        if digests.get("algorithm") != DIGEST_ALGORITHM:
            _fail(where, f"digests.algorithm is {digests.get('algorithm')!r}, not {DIGEST_ALGORITHM!r}")
        claimed = digests.get("root")
        _need(isinstance(claimed, str) and _HEX64.fullmatch(claimed) is not None, where,
              "digests.root must be 64 lower-case hex digits")
        if raw is not None:
            _check_root_digest(raw, claimed, where)
        arr = digests.get("arrays")
        _need(isinstance(arr, dict) and all(isinstance(v, str) and _HEX64.fullmatch(v) for v in arr.values()),
              where, "digests.arrays must map array paths to 64 lower-case hex digits")
    save_id = attrs.get("save_id")
    if not (isinstance(save_id, str) and _SAVE_ID.fullmatch(save_id) is not None):
        _fail(where, f"save_id must be 16 to 64 lower-case hex digits, found {save_id!r}")
    ws = attrs.get("world_size")
    if not _is_int(ws, 1):
        _fail(where, f"bad world_size {ws!r}")
    for name in ("created", "committed"):
        if not _timestamp(attrs.get(name)):
            _fail(where, f"{name} must be a UTC time like "
                  f"2026-11-26T04:58:20.396513Z, found {attrs.get(name)!r}")
    writer = attrs.get("writer")
    _need(isinstance(writer, dict) and all(isinstance(v, str) for v in writer.values()), where,
          "writer must be an object of version strings")
    num_arrays = attrs.get("num_arrays")
    if not _is_int(num_arrays):
        _fail(where, f"num_arrays must be an integer >= 0, found {num_arrays!r}")
    metadata = attrs.get("metadata")
    _need(minor >= 1 or metadata is None, where, "a root of version 1.0 has no 'metadata' (spec §6.1: since 1.1)")
    if metadata is not None:
        if not isinstance(metadata, dict):
            _fail(where, f"metadata must be an object, found {_json_type(metadata)}")
        try:
            ztree.parse_tree({"dict": [["metadata", {"json": metadata}]]})
        except FormatError as e:
            raise FormatError(f"{where}: metadata: {e}") from None
    tree = attrs.get("tree")
    leaves = ztree.parse_tree(tree)
    paths = set()
    for _, key, node in leaves:
        if "array" in node:
            paths.add(key)
        elif "packed" in node:
            packed = parse_packed(node["packed"], key)
            if not (minor >= 1 or packed.kind not in _KINDS_SINCE_1_1):
                _fail(where, f"packed leaf {key!r}: kind {packed.kind!r} does not exist in format 1.0")
            paths.add(packed.metadata["pack"])
    if num_arrays != len(paths):
        _fail(where, f"num_arrays is {num_arrays} but the tree names {len(paths)} arrays (array nodes and packs)")
    array_digests = None
    if digests is not None:
        array_digests = dict(digests["arrays"])
        _lists_the_arrays(array_digests, paths, where, "digests.arrays", "a digest")
    # consolidated metadata is used from 1.2 on, where the root digest covers it; an older
    # root's (added by a generic tool, say) is not the writer's and is ignored
    consolidated = (_parse_consolidated(doc.get("consolidated_metadata"), paths, minor, where)
                    if minor >= 2 else None)
    # the table of chunk positions is used from 1.3 on, where it is REQUIRED; an older
    # root's member of that name is not this format's and is ignored (spec §9)
    chunk_tables = None
    if minor >= 3:
        chunk_tables = digests.get("chunks")
        if not (isinstance(chunk_tables, dict) and all(isinstance(v, str) for v in chunk_tables.values())):
            _fail(where, f"a committed root of version {version} must record digests.chunks, an object of base64 "
                  "strings (spec §6.6)")
        _lists_the_arrays(chunk_tables, paths, where, "digests.chunks", "a table")
    return RootInfo(version, save_id, ws, attrs["created"], dict(writer), tree, doc,
                    tuple(leaves), frozenset(paths), array_digests, metadata, consolidated, chunk_tables)


def _parse_consolidated(cm: Any, paths: set[str], minor: int, where: str) -> dict[str, Any] | None:
    """The root's ``consolidated_metadata`` (spec §6.7): REQUIRED from 1.2, and then exactly
    the checkpoint's arrays and their intermediate groups; each array entry is parsed
    (:func:`parse_array`) when it is used, like the document it stands for."""
    if cm is None:
        _need(minor < 2, where, "a committed root of version 1.2 or later must carry consolidated_metadata")
        return None
    _need(isinstance(cm, dict) and set(cm) == {"kind", "must_understand", "metadata"}
          and cm.get("kind") == "inline" and cm.get("must_understand") is False
          and isinstance(cm.get("metadata"), dict), where,
          'consolidated_metadata must be exactly {"kind": "inline", "must_understand": false, '
          '"metadata": {...}} (spec §6.7)')
    nodes = cm["metadata"]
    groups = set(group_paths(paths))
    if set(nodes) != paths | groups:
        extra, missing = sorted(set(nodes) - paths - groups), sorted(paths | groups - set(nodes))
        raise FormatError(f"{where}: consolidated_metadata does not list exactly the checkpoint's arrays and "
                          "groups" + (f"; not in the tree: {extra[:5]}" if extra else "")
                          + (f"; missing: {missing[:5]}" if missing else ""))
    for path, node in nodes.items():
        kind = "array" if path in paths else "group"
        if not (isinstance(node, dict) and node.get("node_type") == kind and node.get("zarr_format") == 3
              and _is_int(node.get("zarr_format"))):
            _fail(where, f"consolidated_metadata entry {path!r} must be the {kind} document of {path!r}")
        if kind == "group":  # spec §6.7: a group below the root is never a checkpoint; the rest is ignored
            attributes = node.get("attributes", {})
            if not (isinstance(attributes, dict) and ATTR not in attributes):
                _fail(where, f"consolidated_metadata entry {path!r}: a group document has no '{ATTR}' attributes")
    return nodes


def _check_root_digest(raw: bytes, claimed: str, where: str) -> None:
    count = raw.count(claimed.encode("ascii"))
    if count != 1:
        raise IntegrityError(f"{where}: its digest {claimed} occurs {count} times in the document, "
                             "not once: the file was changed after the commit")
    actual = root_digest(raw, claimed)
    if actual != claimed:
        raise IntegrityError(
            f"{where} does not match its own digest (recorded {claimed}, computed {actual}): "
            "the root was changed after the commit (a damaged or edited file); its tree, values "
            "and array digests cannot be trusted")


def check_array_digest(root: RootInfo, path: str, data: bytes, key: str | None = None) -> None:
    """Verify the bytes of ``<path>/zarr.json`` against the root's digests (1.1 and later)."""
    if root.array_digests is None:
        return
    want = root.array_digests.get(path)
    name = f"array {key!r}" if key and key != path else f"array {path!r}"
    if want is None:
        raise IntegrityError(f"{name}: {path!r} has no digest in the root zarr.json")
    got = sha256_hex(bytes(data))
    if got != want:
        raise IntegrityError(
            f"{name}: {path}/zarr.json does not match its digest in the root zarr.json "
            f"(recorded {want[:16]}..., computed {got[:16]}...): it was changed after the commit")


def parse_packed(desc: Any, key: str) -> ArrayInfo:
    """Validate a ``packed`` tree node (spec §6.5) into the ArrayInfo of the leaf it holds;
    ``metadata`` holds the descriptor."""
    where = f"packed leaf {key!r}"
    _need(isinstance(desc, dict), where, "descriptor must be an object")
    members = {"pack", "offset", "nbytes", "kind", "data_type", "shape"}
    if set(desc) != members:
        _fail(where, f"descriptor must have exactly the members {sorted(members)}, "
              f"found {sorted(desc)}")
    pack = desc["pack"]
    if not (isinstance(pack, str) and _PACK_PATH.fullmatch(pack) is not None):
        _fail(where, f"pack must be '.packs/<n>', found {pack!r}")
    if not (_is_int(desc["offset"]) and desc["offset"] % 8 == 0):
        _fail(where, f"offset must be an integer >= 0 and a multiple of 8, found {desc['offset']!r}")
    if not _is_int(desc["nbytes"]):
        _fail(where, f"nbytes must be an integer >= 0, found {desc['nbytes']!r}")
    if desc["kind"] not in PACKED_KINDS:
        _fail(where, f"unknown packed kind {desc['kind']!r}")
    dt = _dtype(desc["data_type"], where)
    shape = desc["shape"]
    if not _int_list(shape, 0):
        _fail(where, f"bad shape {shape!r}")
    if desc["kind"] in BYTE_KINDS:
        if not (dt.zarr == "uint8" and len(shape) == 1):
            _fail(where, f"{desc['kind']} must be 1-d uint8")
    _need(math.prod(shape) * dt.numpy.itemsize == desc["nbytes"], where, "nbytes disagrees with shape")
    return ArrayInfo(key, desc["kind"], tuple(shape), dt, tuple(shape), None, None, None, dict(desc))


def _dtype(name: Any, where: str) -> dtypes.DType:
    if not isinstance(name, str):
        _fail(where, f"data_type must be a name, found {name!r:.40}")
    try:
        return dtypes.by_zarr(name)
    except UnsupportedValueError as e:
        raise FormatError(f"{where}: {e}") from None


_ARRAY_MEMBERS = ("zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
                  "fill_value", "codecs", "attributes", "dimension_names")


# kinds a 1.0 checkpoint cannot hold (spec §10: added in 1.1), so that a 1.1 checkpoint
# relabelled "1.0" to drop its digests is refused rather than read unchecked
_KINDS_SINCE_1_1 = ("sharded_tensor", "bytesio")


def parse_array(doc: Any, key: str, save_id: str | None = None, *, path: str | None = None,
                pack: bool | None = None, version: str | None = None) -> ArrayInfo:
    """Validate an array ``zarr.json`` (spec §5) for the leaf ``key`` stored at ``path``
    (default: ``key``). ``pack``: True for a pack array, False for an array node's array.
    Anything outside the feature set of spec §5.5 is refused, not guessed."""
    if doc is None:
        raise CorruptChunkError(f"array {key!r} is listed in the checkpoint but its zarr.json is missing")
    where = f"array {key!r}"
    if not isinstance(doc, dict):
        _fail(where, f"zarr.json must be an object, found {_json_type(doc)}")
    _need(_is_int(doc.get("zarr_format")) and doc.get("zarr_format") == 3 and doc.get("node_type") == "array",
          where, "not a Zarr v3 array")
    for name in doc:
        if name not in _ARRAY_MEMBERS and name != "storage_transformers":
            ext = doc[name]
            if not (isinstance(ext, dict) and ext.get("must_understand") is False):
                _fail(where, f"unknown member {name!r} (only extensions with \"must_understand\": false are ignored)")
    _need(doc.get("storage_transformers", []) == [], where, "storage transformers are not supported")
    for name in _ARRAY_MEMBERS[:-1]:
        if name not in doc:
            _fail(where, f"member {name!r} is missing")
    dt = _dtype(doc["data_type"], where)
    shape = doc["shape"]
    if not _int_list(shape, 0):
        _fail(where, f"shape must be at most {MAX_RANK} integers >= 0, found {shape!r:.80}")
    if not math.prod(shape) * dt.numpy.itemsize <= MAX_INDEX:
        _fail(where, f"shape {shape} is too large")
    ndim = len(shape)
    grid = doc["chunk_grid"]
    _need(isinstance(grid, dict) and set(grid) <= {"name", "configuration"} and grid.get("name") == "regular"
          and isinstance(grid.get("configuration"), dict) and set(grid["configuration"]) == {"chunk_shape"},
          where, "chunk_grid must be {\"name\": \"regular\", \"configuration\": {\"chunk_shape\": [...]}}")
    chunk = grid["configuration"]["chunk_shape"]
    if not (_int_list(chunk, 1) and len(chunk) == ndim):
        _fail(where, f"bad chunk_shape {chunk!r:.80}")
    if not all(c <= max(s, 1) for c, s in zip(chunk, shape)):
        _fail(where, f"chunk_shape {chunk} is larger than the shape {shape}")
    cke = doc["chunk_key_encoding"]
    _need(isinstance(cke, dict) and set(cke) <= {"name", "configuration"} and cke.get("name") == "default"
          and cke.get("configuration", {"separator": "/"}) == {"separator": "/"}, where,
          "chunk_key_encoding must be \"default\" with separator \"/\"")
    _check_fill(doc["fill_value"], dt, where)
    inner = _check_codecs(doc["codecs"], tuple(chunk), dt, where)
    names = doc.get("dimension_names")
    _need(names is None or (isinstance(names, list) and len(names) == ndim
                            and all(n is None or isinstance(n, str) for n in names)), where,
          "dimension_names must be null or one string (or null) per dimension")
    attributes = doc["attributes"]
    if not isinstance(attributes, dict):
        _fail(where, f"attributes must be an object, found {_json_type(attributes)}")
    attrs = attributes.get(ATTR)
    if not isinstance(attrs, dict):
        _fail(where, f"no '{ATTR}' attributes object")
    sid = attrs.get("save_id")
    if not (isinstance(sid, str) and _SAVE_ID.fullmatch(sid) is not None):
        _fail(where, f"bad save_id {sid!r}")
    if save_id is not None and sid != save_id:
        raise FormatError(
            f"{where} belongs to save {sid!r}, not to this checkpoint's save "
            f"{save_id!r}: the directory mixes two saves")
    if not ("torch_dtype" not in attrs or attrs["torch_dtype"] == dt.torch):
        _fail(where, f"torch_dtype {attrs.get('torch_dtype')!r} disagrees with data_type {dt.zarr!r}")
    kind = attrs.get("kind")
    if kind not in ARRAY_KINDS:
        _fail(where, f"unknown kind {kind!r}")
    if version == "1.0" and kind in _KINDS_SINCE_1_1:
        _fail(where, f"kind {kind!r} does not exist in format 1.0 (the root says 1.0)")
    if pack is not None:
        _need((kind == "pack") == pack, where,
              "a pack array must have kind 'pack'" if pack else "kind 'pack' at a key's array path")
    if kind in BYTE_KINDS:
        if not (dt.zarr == "uint8" and ndim == 1):
            _fail(where, f"kind {kind!r} must be a 1-d uint8 array")
    mesh_shape = names_ = placements = None
    if kind in MESH_KINDS:
        mesh_shape, names_, placements = _parse_mesh(attrs, kind, ndim, where)
    else:
        if not ("mesh" not in attrs and "placements" not in attrs):
            _fail(where, f"kind {kind!r} has no mesh or placements")
    clean = {name: doc[name] for name in _ARRAY_MEMBERS if name in doc}
    return ArrayInfo(key, kind, tuple(shape), dt, tuple(chunk), mesh_shape, names_, placements,
                     clean, inner)


def _parse_mesh(attrs: dict, kind: str, ndim: int, where: str):
    mesh = attrs.get("mesh")
    if not isinstance(mesh, dict):
        _fail(where, f"a {kind} needs a 'mesh' object")
    shape = mesh.get("shape")
    if not (_int_list(shape, 1) and len(shape) >= 1):
        _fail(where, f"bad mesh shape {shape!r:.80}")
    names = mesh.get("dim_names")
    _need(names is None or (isinstance(names, list) and len(names) == len(shape)
                            and all(isinstance(n, str) for n in names)), where,
          "mesh dim_names must be null or one string per mesh dimension")
    _need(mesh.get("device_type") is None or isinstance(mesh.get("device_type"), str), where,
          "mesh device_type must be a string or null")
    raw = attrs.get("placements")
    _need(isinstance(raw, list) and len(raw) == len(shape), where,
          "placements must be a list with one placement per mesh dimension")
    placements = []
    for p in raw:
        _check_placement(p, ndim, where)
        try:
            placements.append(placement_from_json(p))
        except UnsupportedPlacementError as e:  # pragma: no cover - _check_placement covers it
            raise FormatError(f"{where}: bad placement ({e})") from None
    if kind == "sharded_tensor":
        _need(len(shape) == 1 and raw[0]["type"] in ("shard", "replicate")
              and (raw[0]["type"] == "shard") == (ndim > 0), where,
              "a sharded_tensor has a 1-d mesh and placements [shard d] ([replicate] when 0-d)")
    return tuple(shape), tuple(names) if names else None, tuple(placements)


_PLACEMENT_MEMBERS = {"shard": {"type", "dim"}, "strided_shard": {"type", "dim", "split_factor"},
                      "replicate": {"type"}}


def _check_placement(p: Any, ndim: int, where: str) -> None:
    if not (isinstance(p, dict) and p.get("type") in _PLACEMENT_MEMBERS):
        _fail(where, f"bad placement {p!r:.80}")
    if not set(p) == _PLACEMENT_MEMBERS[p["type"]]:
        _fail(where, f"placement {p['type']!r} must have exactly the members {sorted(_PLACEMENT_MEMBERS[p['type']])}")
    if "dim" in p:
        if not _is_int(p["dim"], 0, ndim - 1):
            _fail(where, f"placement dim {p['dim']!r} is not a dimension of "
                  f"this {ndim}-d array")
    if "split_factor" in p:
        if not _is_int(p["split_factor"], 1):
            _fail(where, f"bad split_factor {p['split_factor']!r}")


def _float_fill(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float)):
        return True
    return v in ("NaN", "Infinity", "-Infinity") or (isinstance(v, str) and _HEX_FILL.fullmatch(v) is not None)


def _check_fill(v: Any, dt: dtypes.DType, where: str) -> None:
    """A fill value of the data type's JSON form (Zarr v3 core / TensorStore)."""
    kind = dt.numpy.kind
    if dt.zarr == "bool":
        ok = isinstance(v, bool)
    elif kind in "iu":
        info = np.iinfo(dt.numpy)
        ok = _is_int(v, int(info.min), int(info.max))
    elif kind == "c":  # each part a fill value of the component type (spec §5.2)
        part = 2 + dt.numpy.itemsize  # hex digits of a float of half the complex's size, and "0x"
        ok = isinstance(v, list) and len(v) == 2 and all(
            _float_fill(x) and not (isinstance(x, str) and x.startswith("0x") and len(x) != part) for x in v)
    else:
        ok = _float_fill(v)
        if ok and isinstance(v, str) and v.startswith("0x"):
            ok = len(v) == 2 + 2 * dt.numpy.itemsize
    if not ok:
        _fail(where, f"fill_value {v!r:.40} is not a {dt.zarr} value")


def _check_chain(codecs: Any, dt: dtypes.DType, where: str) -> None:
    """[bytes (little endian), optionally zstd or gzip, crc32c] (spec §5.5)."""
    _need(isinstance(codecs, list) and len(codecs) in (2, 3), where,
          "codecs must be [bytes, (zstd | gzip)?, crc32c]")
    _need(codecs[0] == _BYTES_CODEC, where, "the first codec must be bytes with endian \"little\"")
    last = codecs[-1]
    _need(isinstance(last, dict) and last.get("name") == "crc32c"
          and set(last) <= {"name", "configuration"} and last.get("configuration", {}) == {}, where,
          "the last codec must be crc32c: every chunk carries a checksum")
    if len(codecs) == 3:
        c = codecs[1]
        ok = isinstance(c, dict) and set(c) == {"name", "configuration"} and isinstance(c["configuration"], dict)
        if ok and c["name"] == "zstd":
            cfg = c["configuration"]
            ok = (set(cfg) == {"level", "checksum"} and _is_int(cfg["level"], -131072, 22)
                  and isinstance(cfg["checksum"], bool))
        elif ok and c["name"] == "gzip":
            ok = set(c["configuration"]) == {"level"} and _is_int(c["configuration"]["level"], 0, 9)
        else:
            ok = False
        if not ok:
            _fail(where, f"unsupported compression codec {c!r:.80} (zstd or gzip only)")


def _check_codecs(codecs: Any, chunk: tuple[int, ...], dt: dtypes.DType, where: str) -> tuple[int, ...] | None:
    """The codecs of spec §5.5; returns the inner chunk shape when sharded."""
    if isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict) \
            and codecs[0].get("name") == "sharding_indexed":
        c = codecs[0]
        cfg = c.get("configuration")
        _need(set(c) == {"name", "configuration"} and isinstance(cfg, dict)
              and {"chunk_shape", "codecs", "index_codecs"} <= set(cfg)
              <= {"chunk_shape", "codecs", "index_codecs", "index_location"}, where,
              "sharding_indexed needs exactly chunk_shape, codecs, index_codecs (and index_location)")
        inner = cfg["chunk_shape"]
        if not (_int_list(inner, 1) and len(inner) == len(chunk) and len(chunk) > 0
              and all(c % i == 0 for c, i in zip(chunk, inner))):
            _fail(where, f"inner chunk_shape {inner!r:.80} must divide the chunk shape {list(chunk)}")
        _check_chain(cfg["codecs"], dt, where)
        _need(cfg["index_codecs"] == PLAIN_CODECS, where,
              "index_codecs must be [bytes (little endian), crc32c]")
        _need(cfg.get("index_location", "end") == "end", where, "the shard index must be at the end")
        return tuple(inner)
    _check_chain(codecs, dt, where)
    return None
