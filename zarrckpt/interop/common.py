"""What every converter shares: leaves, pieces, strided reads from files, key selection,
dtype casting, nesting. Torch-free.

A *source* lists its leaves (metadata only) and reads any box of an array leaf; a *sink*
takes the leaves in order and writes each array piece by piece. A piece is a box of at
most a budget of bytes that is contiguous in C order (``piece_shape``), so that file
formats write it with one sequential write and Zarr stores it as exactly one chunk.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from ..format import dtypes as zdt
from ..format import tree as ztree
from ..format.layout import piece_boxes, piece_shape
from ..errors import FormatError, UnsupportedValueError
from ..storage import storage_error

Box = tuple  # tuple[tuple[int, int], ...]


# ------------------------------------------------------------------ leaves


@dataclass
class ArrayLeaf:
    """An array of a source: metadata, and ``read(box)`` -> a C-contiguous array of the box
    in ``dtype`` (the caller owns it)."""

    path: tuple
    shape: tuple[int, ...]
    dtype: zdt.DType
    read: Callable[[Box], np.ndarray]
    kind: str = "tensor"  # tensor | ndarray | bytes | bytesio
    containers: tuple[str, ...] | None = None  # kind of each container on the way

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.numpy.itemsize


@dataclass
class ValueLeaf:
    """A non-array value (JSON-able, non-finite floats) of a source."""

    path: tuple
    value: Any
    containers: tuple[str, ...] | None = None


@dataclass
class Skipped:
    """A leaf a source or sink cannot convert, and why."""

    path: tuple
    reason: str


Leaf = Union[ArrayLeaf, ValueLeaf, Skipped]


def in_memory_leaf(path: tuple, data: np.ndarray, kind: str = "tensor",
                   containers: tuple[str, ...] | None = None) -> ArrayLeaf:
    """An array leaf whose data is already in memory (small values of a source)."""
    data = np.require(data, requirements="C")

    def read(box: Box) -> np.ndarray:
        return np.array(data[tuple(slice(a, b) for a, b in box)], copy=True, order="C")

    return ArrayLeaf(tuple(path), tuple(data.shape), zdt.by_numpy(data.dtype), read, kind, containers)


def key_of(path: tuple) -> str:
    return ztree.key_of(path)


def dotted(path: tuple) -> str:
    """A flat name of a key path, as torch and Hugging Face write them: ``a.b.0.c``."""
    return ".".join(str(c) for c in path)


# ------------------------------------------------------------------ pieces


# ------------------------------------------------------------------ files


class RawFile:
    """A file read by offset (``pread``), named in every error."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise storage_error(f"opening {path}", e) from e
        try:
            self.size = os.fstat(self.fd).st_size
        except OSError as e:  # pragma: no cover
            os.close(self.fd)
            raise storage_error(f"inspecting {path}", e) from e

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` from ``offset``; a file that ends first is a FormatError."""
        buf = buf.cast("B")
        done = 0
        while done < len(buf):
            try:
                n = os.preadv(self.fd, [buf[done:]], offset + done)
            except OSError as e:
                raise storage_error(f"reading {self.path}", e) from e
            if n == 0:
                raise FormatError(f"{self.path} ends at byte {offset + done}, before the {len(buf)} bytes "
                                  f"at offset {offset} that its header describes (a truncated file?)")
            done += n

    def read(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf), offset)
        return bytes(buf)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class StridedReader:
    """The elements of a tensor laid out in a file: from byte ``base`` (the storage's start),
    ``shape`` with ``strides`` (in elements, >= 0) from element ``storage_offset``. Reads any
    box with bounded memory: a box whose storage span is larger than ``limit`` bytes is
    split along its largest stride and read in parts."""

    def __init__(self, f: RawFile, base: int, dtype: np.dtype, shape: Sequence[int], strides: Sequence[int],
                 storage_offset: int, storage_elems: int, where: str, limit: int = 64 << 20,
                 byteswap: bool = False) -> None:
        self.f, self.base, self.dtype, self.where, self.limit, self.swap = f, base, np.dtype(dtype), where, limit, byteswap
        self.shape, self.strides, self.offset = tuple(shape), tuple(strides), storage_offset
        if any(s < 0 for s in self.strides) or storage_offset < 0:
            raise FormatError(f"{where}: negative strides or offset")
        if math.prod(self.shape):
            last = storage_offset + sum((n - 1) * s for n, s in zip(self.shape, self.strides))
            if last >= storage_elems:
                raise FormatError(f"{where}: a tensor of shape {self.shape} and strides {self.strides} from "
                                  f"element {storage_offset} reaches past its storage of {storage_elems} elements")

    def read(self, box: Box) -> np.ndarray:
        out = np.empty([b - a for a, b in box], dtype=self.dtype)
        if out.size:
            self._read_into(tuple(box), out)
            if self.swap and self.dtype.itemsize > 1:
                out.byteswap(inplace=True)
        return out

    def _read_into(self, box: Box, out: np.ndarray) -> None:
        ext = [b - a for a, b in box]
        isz = self.dtype.itemsize
        first = self.offset + sum(a * s for (a, _), s in zip(box, self.strides))
        span = sum((e - 1) * s for e, s in zip(ext, self.strides)) + 1
        if _c_contiguous(ext, self.strides) and out.flags.c_contiguous:
            self.f.read_into(memoryview(out.reshape(-1).view(np.uint8)), self.base + first * isz)
            return
        if span * isz <= max(self.limit, out.nbytes) or out.size == 1:
            buf = np.empty(span, dtype=self.dtype)
            self.f.read_into(memoryview(buf.view(np.uint8)), self.base + first * isz)
            out[...] = zdt.as_strided(buf, tuple(ext), tuple(s * isz for s in self.strides))
            return
        d = max((d for d in range(len(ext)) if ext[d] > 1), key=lambda d: self.strides[d])
        mid = ext[d] // 2
        lo, hi = list(box), list(box)
        lo[d] = (box[d][0], box[d][0] + mid)
        hi[d] = (box[d][0] + mid, box[d][1])
        sl_lo = tuple(slice(0, mid) if i == d else slice(None) for i in range(len(ext)))
        sl_hi = tuple(slice(mid, None) if i == d else slice(None) for i in range(len(ext)))
        self._read_into(tuple(lo), out[sl_lo])
        self._read_into(tuple(hi), out[sl_hi])


def _c_contiguous(ext: Sequence[int], strides: Sequence[int]) -> bool:
    expect = 1
    for e, s in zip(reversed(list(ext)), reversed(list(strides))):
        if e > 1 and s != expect:
            return False
        expect *= e
    return True


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(list(shape)):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


# ------------------------------------------------------------------ key selection


KeysArg = Union[None, str, Sequence[str], Mapping[str, str], Callable[[str], Union[str, None]]]


def key_selector(keys: KeysArg) -> Callable[[str], str | None]:
    """``keys`` -> a function from a leaf's key to its new key, or None to leave it out.

    * None: every key, unchanged.
    * a string or a sequence of strings: the keys that start with one of them (a string
      prefix: ``"model/"`` is the subtree ``model``, ``"model.layers.0."`` the Hugging Face
      names of layer 0), unchanged.
    * a mapping ``{old prefix: new prefix}``: the keys that start with an old prefix (the
      longest that matches), with it replaced (``{"model/": ""}`` drops the ``model/``).
    * a callable: ``f(key)`` returns the new key, or None to leave the leaf out.

    Keys are zarrckpt keys (spec §4: escaped components joined by ``/``); a flat name such
    as ``"model.layers.0.weight"`` is one component, and its own key.
    """
    if keys is None:
        return lambda k: k
    if callable(keys) and not isinstance(keys, (str, Mapping)):
        return keys  # type: ignore[return-value]
    if isinstance(keys, str):
        keys = [keys]
    if isinstance(keys, Mapping):
        pairs = sorted(((str(a), str(b)) for a, b in keys.items()), key=lambda p: -len(p[0]))

        def rename(k: str) -> str | None:
            for old, new in pairs:
                if k.startswith(old):
                    return new + k[len(old):]
            return None

        return rename
    prefixes = tuple(str(p) for p in keys)
    return lambda k: k if k.startswith(prefixes) else None


def path_of_key(key: str) -> tuple:
    """The key path of a (renamed) key: its segments unescaped (spec §4.3)."""
    if not key:
        raise ValueError("a renamed key is empty")
    return tuple(ztree.unescape(seg) for seg in key.split("/"))


def renamed(path: tuple, containers: tuple[str, ...] | None, key: str,
            new: str) -> tuple[tuple, tuple[str, ...] | None]:
    """The key path and container kinds of a leaf whose key ``key`` (of ``path``) became
    ``new``. The segments both keys end with keep their components (an index stays an int)
    and the kinds of the containers that hold them, so ``{"optim/": ""}`` keeps
    ``param_groups`` a list and ``state`` keyed by ints; the segments in front, new or
    renamed, are dict keys (their unescaped strings)."""
    if new == key:
        return path, containers
    new_path = path_of_key(new)
    old_segs, new_segs = key.split("/"), new.split("/")
    n = 0
    while n < min(len(old_segs), len(new_segs), len(path)) and old_segs[-1 - n] == new_segs[-1 - n]:
        n += 1
    kinds = tuple(containers or ())[:len(path) - 1]
    kinds += ("dict",) * (len(path) - 1 - len(kinds))
    holders = ("dict",) + kinds  # holders[i]: the kind of the container that holds path[i]
    head = new_path[:len(new_path) - n]
    new_holders = ("dict",) * len(head) + holders[len(path) - n:]
    return head + tuple(path[len(path) - n:]), new_holders[1:]


# ------------------------------------------------------------------ dtypes

_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
            "fp64": "float64", "double": "float64", "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn"}


def as_dtype(d: Any) -> zdt.DType:
    """A zarrckpt dtype row from a name (``"bfloat16"``, ``"bf16"``, ``"torch.float16"``), a
    torch dtype or a NumPy dtype."""
    if isinstance(d, zdt.DType):
        return d
    if isinstance(d, str):
        name = d.strip().lower().removeprefix("torch.")
        return zdt.by_zarr(_ALIASES.get(name, name))
    if type(d).__module__ == "torch":
        return zdt.by_torch(d)
    return zdt.by_numpy(np.dtype(d))


def is_float(dt: zdt.DType) -> bool:
    return dt.numpy.kind == "f" or dt.zarr == "bfloat16" or dt.zarr.startswith("float8")


def dtype_caster(dtype: Any) -> Callable[[zdt.DType], zdt.DType]:
    """``dtype`` -> a function from a leaf's dtype to the dtype it is written in.

    None: unchanged. A single dtype: every floating-point array (float16/32/64, bfloat16,
    float8) is cast to it; integers, booleans and complex arrays are unchanged. A mapping
    ``{from: to}``: exactly those dtypes."""
    if dtype is None:
        return lambda dt: dt
    if isinstance(dtype, Mapping):
        table = {as_dtype(a).zarr: as_dtype(b) for a, b in dtype.items()}
        return lambda dt: table.get(dt.zarr, dt)
    target = as_dtype(dtype)
    return lambda dt: target if is_float(dt) else dt


def cast(data: np.ndarray, to: zdt.DType) -> np.ndarray:
    """``data`` in dtype ``to`` (round to nearest even, ml_dtypes/NumPy rules)."""
    if data.dtype == to.numpy:
        return data
    return data.astype(to.numpy)


# ------------------------------------------------------------------ nesting


def nest(items: Sequence[tuple[tuple, tuple[str, ...] | None, Any]]) -> dict:
    """A nested object from ``(key path, container kinds, value)`` items: containers are
    dicts unless a kind says ``"list"``/``"tuple"`` (gaps in a list are None, as DCP's
    loader fills them)."""
    root: dict = {}
    kinds: dict[int, str] = {}
    for path, containers, value in items:
        node: Any = root
        for depth, comp in enumerate(path[:-1]):
            if comp not in node:  # (a None leaf is there: no node.get)
                node[comp] = {}
                kinds[id(node[comp])] = (containers[depth] if containers and depth < len(containers) else "dict")
            child = node[comp]
            if not isinstance(child, dict) or id(child) not in kinds:
                raise ValueError(f"{key_of(path[:depth + 1])!r} is a leaf; cannot add {key_of(path)!r} under it")
            node = child
        if path[-1] in node:
            raise ValueError(f"{key_of(path)!r} appears twice")
        node[path[-1]] = value

    def build(node: Any) -> Any:
        if not isinstance(node, dict) or id(node) not in kinds and node is not root:
            return node
        items = {k: build(v) for k, v in node.items()}
        kind = kinds.get(id(node), "dict")
        if kind == "dict":
            return items
        if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in items):
            return items
        seq = [items.get(i) for i in range(max(items) + 1)] if items else []
        return tuple(seq) if kind == "tuple" else seq

    return build(root)


def leaf_error(path: tuple, e: BaseException) -> UnsupportedValueError:
    return UnsupportedValueError(f"{key_of(path)!r}: {e}")


__all__ = ["ArrayLeaf", "Box", "KeysArg", "Leaf", "RawFile", "Skipped", "StridedReader",
           "ValueLeaf", "as_dtype", "c_strides", "cast", "dotted", "dtype_caster", "in_memory_leaf", "is_float",
           "key_of", "key_selector", "nest", "path_of_key", "piece_boxes", "piece_shape", "renamed"]
