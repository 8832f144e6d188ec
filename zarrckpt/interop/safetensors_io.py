"""Hugging Face safetensors files, read and written here without torch or the
``safetensors`` package (whose writer needs every tensor in memory at once).

The format (safetensors' README and ``docs/safetensors.schema.json``): 8 bytes, a
little-endian u64 ``N``; ``N`` bytes of a UTF-8 JSON object mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that follows
the header), plus an optional ``"__metadata__"`` object of strings; then the data, C
order, little-endian, every byte belonging to exactly one tensor. A sharded checkpoint is
several such files and ``<prefix>.safetensors.index.json``: ``{"metadata": {"total_size":
bytes}, "weight_map": {name: file}}``.

Reading checks what safetensors checks (header size, JSON, dtypes, offsets that tile the
data with no gap or overlap, sizes agreeing with shapes) and raises FormatError naming
the file and tensor. Writing lays out the header first (offsets follow from shapes), then
streams each tensor's pieces; files are written under temporary names and renamed once
all are complete, the index last.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format import dtypes as zdt
from ..format import documents as fmt
from ..errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, UnsupportedValueError
from .common import ArrayLeaf, RawFile, StridedReader, c_strides

MAX_HEADER = 100_000_000  # safetensors' limit on N
INDEX_SUFFIX = ".safetensors.index.json"

# safetensors dtype name <-> zarrckpt data_type (safetensors.torch._TYPES, plus F8_E8M0)
TO_ZARR = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
FROM_ZARR = {v: k for k, v in TO_ZARR.items()}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: zdt.DType
    shape: tuple[int, ...]
    begin: int  # into the data section
    end: int


@dataclass
class File:
    path: str
    entries: list[Entry]  # in data order
    metadata: dict[str, str] | None
    data_start: int


def read_header(f: RawFile) -> File:
    """Parse and check one file's header (spec of safetensors)."""
    where = f.path
    if f.size < 8:
        raise FormatError(f"{where} is not a safetensors file: {f.size} bytes, shorter than the 8-byte header size")
    n = int.from_bytes(f.read(0, 8), "little")
    if n > MAX_HEADER:
        raise FormatError(f"{where}: header of {n} bytes, over safetensors' limit of {MAX_HEADER} "
                          "(not a safetensors file?)")
    if 8 + n > f.size:
        raise FormatError(f"{where}: header of {n} bytes but the file has {f.size} bytes "
                          "(not a safetensors file, or truncated)")
    raw = f.read(8, n)
    if not raw.lstrip(b" ").startswith(b"{"):
        raise FormatError(f"{where}: the header is not a JSON object (not a safetensors file?)")
    doc = fmt.decode_document(raw.rstrip(b" \x00"), f"{where}: safetensors header")
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise FormatError(f"{where}: __metadata__ must map strings to strings")
    data_size = f.size - 8 - n
    entries = []
    for name, info in doc.items():
        t = f"{where}: tensor {name!r}"
        if not (isinstance(info, dict) and set(info) == {"dtype", "shape", "data_offsets"}):
            raise FormatError(f"{t}: needs exactly dtype, shape and data_offsets, found {info!r:.100}")
        code, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if code not in TO_ZARR:
            raise UnsupportedValueError(f"{t}: dtype {code!r} has no zarrckpt data type (supported: "
                                        f"{', '.join(TO_ZARR)})")
        if not (isinstance(shape, list) and all(_uint(s) for s in shape) and len(shape) <= fmt.MAX_RANK):
            raise FormatError(f"{t}: bad shape {shape!r:.80}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_uint(o) for o in offs) and offs[0] <= offs[1]):
            raise FormatError(f"{t}: bad data_offsets {offs!r:.80}")
        dt = zdt.by_zarr(TO_ZARR[code])
        if offs[1] - offs[0] != math.prod(shape) * dt.numpy.itemsize:
            raise FormatError(f"{t}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, but shape {shape} of "
                              f"{code} needs {math.prod(shape) * dt.numpy.itemsize}")
        entries.append(Entry(name, dt, tuple(shape), offs[0], offs[1]))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise FormatError(f"{where}: tensor {e.name!r} starts at data byte {e.begin}, expected {pos} "
                              "(tensors must tile the data with no gap or overlap)")
        pos = e.end
    if pos != data_size:
        raise FormatError(f"{where}: the tensors cover {pos} bytes of data but the file holds {data_size} "
                          "(a truncated file, or bytes no tensor owns)")
    return File(f.path, entries, metadata, 8 + n)


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= fmt.MAX_INDEX


# ------------------------------------------------------------------ reading


class Source:
    """A safetensors file, a sharded checkpoint's index, or a directory holding either."""

    def __init__(self, src: str | os.PathLike, limit: int) -> None:
        src = os.fspath(src)
        self.limit = limit
        self.files = _source_files(src)
        self._open: dict[str, RawFile] = {}
        self.headers: list[File] = []
        self.weight_map: dict[str, str] | None = None
        self.metadata: dict[str, str] | None = None
        index = next((p for p in self.files if p.endswith(INDEX_SUFFIX)), None)
        if index is not None:
            self._read_index(index)
        else:
            for p in self.files:
                self.headers.append(read_header(self._file(p)))
        names: dict[str, str] = {}
        for h in self.headers:
            for e in h.entries:
                if e.name in names:
                    raise FormatError(f"tensor {e.name!r} is in both {names[e.name]} and {h.path}")
                names[e.name] = h.path
        metas = [h.metadata for h in self.headers if h.metadata]
        self.metadata = metas[0] if metas else None

    def _file(self, path: str) -> RawFile:
        f = self._open.get(path)
        if f is None:
            if not os.path.isfile(path):
                raise CheckpointNotFoundError(f"safetensors file {path} does not exist")
            f = self._open[path] = RawFile(path)
        return f

    def _read_index(self, index: str) -> None:
        try:
            with open(index, "rb") as fh:
                raw = fh.read(64 << 20)
        except OSError as e:
            from ..storage import storage_error

            raise storage_error(f"reading {index}", e) from e
        doc = fmt.decode_document(raw, index)
        wm = doc.get("weight_map")
        if not (isinstance(wm, dict) and wm and all(isinstance(v, str) for v in wm.values())):
            raise FormatError(f"{index}: 'weight_map' must map tensor names to file names")
        base = os.path.dirname(index)
        files = []
        for name in wm.values():
            if name != os.path.basename(name) or name in ("", ".", ".."):
                raise FormatError(f"{index}: weight_map names {name!r}, not a file beside the index")
            if name not in files:
                files.append(name)
        self.weight_map = dict(wm)
        for name in files:
            h = read_header(self._file(os.path.join(base, name)))
            self.headers.append(h)
            listed = {n for n, fl in wm.items() if fl == name}
            held = {e.name for e in h.entries}
            if listed != held:
                extra, missing = sorted(held - listed), sorted(listed - held)
                raise FormatError(f"{index} and {h.path} disagree: "
                                  + (f"in the file but mapped elsewhere or not at all: {extra[:5]}; " if extra else "")
                                  + (f"mapped to it but not in it: {missing[:5]}" if missing else ""))
        meta = doc.get("metadata")
        self.index_metadata = meta if isinstance(meta, dict) else None

    def leaves(self) -> Iterator[ArrayLeaf]:
        for h in self.headers:
            f = self._file(h.path)
            for e in h.entries:
                reader = StridedReader(f, h.data_start + e.begin, e.dtype.numpy, e.shape, c_strides(e.shape), 0,
                                       max(math.prod(e.shape), 1), f"{h.path}: tensor {e.name!r}", self.limit)
                yield ArrayLeaf((e.name,), e.shape, e.dtype, reader.read)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def _source_files(src: str) -> list[str]:
    if os.path.isdir(src):
        names = sorted(os.listdir(src))
        indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
        if len(indexes) > 1 and "model" + INDEX_SUFFIX in indexes:
            indexes = ["model" + INDEX_SUFFIX]
        if len(indexes) > 1:
            raise FormatError(f"{src} holds several safetensors indexes ({', '.join(indexes)}); name one")
        if indexes:
            return [os.path.join(src, indexes[0])]
        files = [n for n in names if n.endswith(".safetensors")]
        if "model.safetensors" in files:
            files = ["model.safetensors"]
        if not files:
            raise CheckpointNotFoundError(f"{src} holds no .safetensors file and no {INDEX_SUFFIX}")
        return [os.path.join(src, n) for n in files]
    if not os.path.exists(src):
        raise CheckpointNotFoundError(f"no safetensors file or directory at {src}")
    return [src]


# ------------------------------------------------------------------ writing


def parse_size(size: int | str | None) -> int | None:
    """``5_000_000_000``, ``"5GB"`` (10^9), ``"2GiB"`` (2^30), ``"500MB"`` ... -> bytes."""
    if size is None or isinstance(size, int):
        if isinstance(size, int) and size <= 0:
            raise ValueError(f"a shard size must be positive, not {size}")
        return size
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(I?)B?\s*", str(size).upper())
    if not m:
        raise ValueError(f"cannot read the size {size!r} (e.g. 5GB, 500MB, 2GiB)")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


@dataclass
class Planned:
    name: str
    dtype: zdt.DType
    shape: tuple[int, ...]
    item: Any  # the caller's

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.numpy.itemsize


def order(items: Sequence[Planned]) -> list[Planned]:
    """Safetensors' own order: larger item sizes first (keeps every tensor aligned), then by name."""
    return sorted(items, key=lambda p: (-p.dtype.numpy.itemsize, p.name))


def shard(items: Sequence[Planned], max_bytes: int | None) -> list[list[Planned]]:
    """Split into files of at most ``max_bytes`` of data, in order (as transformers does: a
    tensor larger than the limit gets a file of its own)."""
    if max_bytes is None:
        return [list(items)]
    shards: list[list[Planned]] = [[]]
    size = 0
    for p in items:
        if shards[-1] and size + p.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def header_bytes(items: Sequence[Planned], metadata: dict[str, str] | None) -> bytes:
    head: dict[str, Any] = {}
    if metadata:
        head["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    for p in items:
        code = FROM_ZARR.get(p.dtype.zarr)
        if code is None:  # pragma: no cover - checked by the caller
            raise UnsupportedValueError(f"{p.name!r}: {p.dtype.zarr} has no safetensors dtype")
        head[p.name] = {"dtype": code, "shape": list(p.shape), "data_offsets": [pos, pos + p.nbytes]}
        pos += p.nbytes
    raw = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw


class FileWriter:
    """One safetensors file written front to back under a temporary name."""

    def __init__(self, final: str, items: Sequence[Planned], metadata: dict[str, str] | None) -> None:
        self.final = final
        self.tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:12]}")
        self.items = list(items)
        self.expected = sum(p.nbytes for p in self.items)
        self.written = 0
        self.fh = open(self.tmp, "wb")
        self.fh.write(header_bytes(self.items, metadata))

    def write(self, data: np.ndarray) -> None:
        data = np.require(data, requirements="C")
        if data.dtype.byteorder == ">":  # pragma: no cover - big-endian hosts
            data = data.byteswap()
        self.fh.write(memoryview(data.reshape(-1).view(np.uint8)))
        self.written += data.nbytes

    def finish(self) -> None:
        if self.written != self.expected:
            raise RuntimeError(f"{self.final}: wrote {self.written} bytes of data, expected {self.expected}")
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()

    def discard(self) -> None:
        try:
            self.fh.close()
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)


def shard_names(prefix: str, n: int) -> list[str]:
    if n == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


_OURS = re.compile(r"(?P<p>.+?)(-[0-9]{5}-of-[0-9]{5})?\.safetensors(\.index\.json)?")


def existing_outputs(folder: str, prefix: str) -> list[str]:
    """Files of an earlier export with this prefix in ``folder`` (replaced by overwrite)."""
    if not os.path.isdir(folder):
        return []
    out = []
    for n in sorted(os.listdir(folder)):
        m = _OURS.fullmatch(n)
        if m and m.group("p") == prefix:
            out.append(os.path.join(folder, n))
    return out


def check_destination(dst: str, prefix: str, overwrite: bool, single_file: bool) -> list[str]:
    """What an export to ``dst`` replaces; refuses without ``overwrite``."""
    if single_file:
        old = [dst] if os.path.exists(dst) else []
    else:
        if os.path.exists(dst) and not os.path.isdir(dst):
            raise CheckpointExistsError(f"{dst} exists and is not a directory")
        old = existing_outputs(dst, prefix)
    if old and not overwrite:
        raise CheckpointExistsError(f"{old[0]} exists; pass overwrite=True to replace "
                                    + ("it" if single_file else f"the {prefix} safetensors files in {dst}"))
    return old


__all__ = ["FROM_ZARR", "FileWriter", "INDEX_SUFFIX", "Planned", "Source", "TO_ZARR", "check_destination",
           "header_bytes", "order", "parse_size", "read_header", "shard", "shard_names"]
