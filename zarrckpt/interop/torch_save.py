"""``torch.save`` files, streamed tensor by tensor (needs torch).

**Reading** unpickles nothing itself: ``torch.load(path, weights_only=True,
map_location="meta")`` runs torch's own restricted unpickler over the file's
``data.pkl`` (tensors, containers and primitive values only; anything else is refused
by torch) and, because the location is ``meta``, reads no tensor data: each storage
comes back empty, carrying ``_checkpoint_offset``, the byte offset of its record in the
zip file (set by meta loads of the torch versions tested, 2.13; an older torch without it
gets a FormatError saying so). The tensor's elements are then read
from that record piece by piece (its size, stride and storage offset say where each
element is), after checking in the zip directory that the record is stored
uncompressed and is as long as the storage.

**Writing** lets torch write the file's structure: ``torch.save`` of the nested object
with *fake* tensors (``FakeTensorMode``: shape and dtype, no memory) under
``torch.serialization.skip_data(materialize_fake_tensors=True)``, which lays out every
storage record at its final size without writing its bytes. A meta load of that file
gives each record's offset; the data are then streamed into place and each record's
CRC-32 is patched in its local header and central directory entry, so the result is an
ordinary, valid ``torch.save`` zip that ``torch.load(weights_only=True)`` reads.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import uuid
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..format import dtypes as zdt
from ..errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, UnsupportedValueError
from .common import ArrayLeaf, RawFile, Skipped, StridedReader, ValueLeaf, in_memory_leaf

_ZIP_MAGIC = b"PK\x03\x04"


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover
        raise ImportError("converting torch.save files and DCP checkpoints needs torch: "
                          "pip install 'zarrckpt[torch]'") from None
    return torch


class View(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a file as a seekable file of their own."""

    def __init__(self, path: str, start: int = 0, length: int | None = None) -> None:
        self._f = open(path, "rb")
        size = os.fstat(self._f.fileno()).st_size
        self.start = start
        self.length = size - start if length is None else length
        if start + self.length > size:
            self._f.close()
            raise FormatError(f"{path}: bytes {start}..{start + self.length} are past its end ({size} bytes)")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self._pos))
        if not n:
            return 0
        self._f.seek(self.start + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got or 0
        return got or 0

    def close(self) -> None:
        self._f.close()
        super().close()


def check_zip(view: View, where: str) -> None:
    view.seek(0)
    if view.read(4) != _ZIP_MAGIC:
        raise FormatError(f"{where} is not a torch.save zip file (a file saved before torch 1.6 or with "
                          "_use_new_zipfile_serialization=False is not supported: load and save it again)")
    view.seek(0)


def records(view: View, where: str) -> tuple[dict[int, zipfile.ZipInfo], str]:
    """The zip's records by the offset of their data, and the byte order it was saved in."""
    try:
        zf = zipfile.ZipFile(view)
    except zipfile.BadZipFile as e:
        raise FormatError(f"{where} is not a torch.save zip file ({e})") from None
    table = {}
    order = "little"
    for info in zf.infolist():
        view.seek(info.header_offset)
        head = view.read(30)
        if len(head) < 30 or head[:4] != _ZIP_MAGIC:
            raise FormatError(f"{where}: bad zip local header for {info.filename}")
        n, e = struct.unpack("<HH", head[26:30])
        table[info.header_offset + 30 + n + e] = info
        if info.filename.endswith("/byteorder") and info.file_size < 16:
            order = zf.read(info).decode("ascii", "replace").strip()
    return table, order


def load_meta(view: View, where: str) -> Any:
    """``torch.load`` with ``weights_only=True`` and ``map_location="meta"``: the object,
    with empty tensors whose storages know their record's offset."""
    torch = _torch()
    check_zip(view, where)
    try:
        return torch.load(view, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsupportedValueError(
            f"{where} holds objects that torch.load(weights_only=True) refuses; zarrckpt unpickles "
            f"nothing else (load it yourself with weights_only=False if you trust it, and save its "
            f"tensors): {refusal(e)}") from None
    except RuntimeError as e:
        raise FormatError(f"{where}: torch.load failed: {str(e)[:400]}") from None


def refusal(e: BaseException) -> str:
    """The line of torch's weights_only error that names what it refused."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if "Unsupported" in ln or "WeightsUnpickler" in ln:
            return ln[:300]
    return (lines[0] if lines else type(e).__name__)[:300]


class TensorFile:
    """Tensors of one torch.save zip (a whole file, or a DCP item inside a file)."""

    def __init__(self, path: str, start: int = 0, length: int | None = None, *, where: str, limit: int) -> None:
        self.where = where
        self.limit = limit
        self.start = start
        self.view = View(path, start, length)
        check_zip(self.view, where)
        self.table, order = records(self.view, where)
        if order not in ("little", "big"):
            raise FormatError(f"{where}: unknown byte order {order!r}")
        self.swap = order != "little"
        self.obj = load_meta(self.view, where)
        self.raw = RawFile(path)

    def reader(self, t: Any, where: str) -> ArrayLeaf | Skipped:
        """An array leaf reading tensor ``t`` (meta, from :func:`load_meta`) from the file."""
        torch = _torch()
        if t.layout != torch.strided or t.is_quantized or t.is_sparse:
            return Skipped((), f"{where}: a {t.layout} / quantized tensor has no zarrckpt form")
        try:
            row = zdt.by_torch(t.dtype)
        except UnsupportedValueError as e:
            return Skipped((), f"{where}: {e}")
        st = t.untyped_storage()
        offset = getattr(st, "_checkpoint_offset", None)
        if offset is None:
            raise FormatError(f"{where}: this torch ({torch.__version__}) does not report where tensor data "
                              "lie in a torch.save file (storage._checkpoint_offset of a meta load); "
                              "upgrade torch")
        info = self.table.get(offset)
        nbytes = st.nbytes()
        if info is None or info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
            raise FormatError(f"{where}: its storage record at byte {offset} is missing, compressed or not "
                              f"{nbytes} bytes long")
        itemsize = row.numpy.itemsize
        reader = StridedReader(self.raw, self.start + offset, row.numpy, tuple(t.shape), tuple(t.stride()),
                               t.storage_offset(), nbytes // itemsize, where, self.limit, self.swap)
        return ArrayLeaf((), tuple(t.shape), row, reader.read)

    def close(self) -> None:
        self.view.close()
        self.raw.close()


def walk(obj: Any, path: tuple = (), containers: tuple = ()) -> Iterator[tuple[tuple, tuple, Any]]:
    """``(key path, container kinds, leaf)`` of a loaded object: dicts, lists and tuples are
    descended into (empty ones, and the root's non-containers, are leaves)."""
    if isinstance(obj, dict) and (obj or not path):
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                yield path + (repr(k),), containers, Skipped(path + (repr(k),), f"a dict key of type {type(k).__name__}")
                continue
            yield from walk(v, path + (k,), containers + ("dict",))
    elif isinstance(obj, (list, tuple)) and obj and path:
        kind = "tuple" if isinstance(obj, tuple) else "list"
        for i, v in enumerate(obj):
            yield from walk(v, path + (i,), containers + (kind,))
    elif not path:
        yield ("value",), ("dict",), obj  # a file holding one object, not a dict
    else:
        yield path, containers, obj


def expand(path: tuple, containers: tuple, value: Any) -> Iterator[ArrayLeaf | ValueLeaf | Skipped]:
    """Leaves of an in-memory value: its CPU tensors become array leaves."""
    torch = _torch()
    nested = isinstance(value, (dict, list, tuple)) and value
    outer = ("dict",) + tuple(containers)  # walk's form: the kind of the root too
    for p, c, v in walk(value, path, outer) if nested else [(path, outer, value)]:
        if isinstance(v, Skipped):
            yield v
        elif isinstance(v, torch.Tensor):
            try:
                zdt.by_torch(v.dtype)
            except UnsupportedValueError as e:
                yield Skipped(p, str(e))
                continue
            yield in_memory_leaf(p, zdt.to_numpy(v.detach().cpu().contiguous()).copy(), "tensor", c[1:])
        elif isinstance(v, (bytes, bytearray)):
            yield in_memory_leaf(p, np.frombuffer(bytes(v), np.uint8), "bytes", c[1:])
        elif isinstance(v, io.BytesIO):
            yield in_memory_leaf(p, np.frombuffer(v.getvalue(), np.uint8), "bytesio", c[1:])
        else:
            yield ValueLeaf(p, v, c[1:])


class Source:
    """A torch.save file."""

    def __init__(self, src: str | os.PathLike, limit: int) -> None:
        path = os.fspath(src)
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"no torch.save file at {path}")
        self.tf = TensorFile(path, where=path, limit=limit)
        self.metadata = None

    def leaves(self) -> Iterator[ArrayLeaf | ValueLeaf | Skipped]:
        torch = _torch()
        for path, containers, v in walk(self.tf.obj):
            if isinstance(v, Skipped):
                yield v
            elif isinstance(v, torch.Tensor):
                leaf = self.tf.reader(v, f"{self.tf.where}: tensor {'.'.join(map(str, path))!r}")
                leaf.path = path
                if isinstance(leaf, ArrayLeaf):
                    leaf.containers = containers[1:]
                yield leaf
            elif isinstance(v, (bytes, bytearray)):
                yield in_memory_leaf(path, np.frombuffer(bytes(v), np.uint8), "bytes", containers[1:])
            else:
                yield ValueLeaf(path, v, containers[1:])

    def close(self) -> None:
        self.tf.close()


# ------------------------------------------------------------------ writing


class Sink:
    """A torch.save file written with bounded memory (see the module docstring)."""

    def __init__(self, dst: str | os.PathLike, overwrite: bool) -> None:
        self.dst = os.path.abspath(os.fspath(dst))
        if os.path.isdir(self.dst):
            raise CheckpointExistsError(f"{self.dst} is a directory; a torch.save file is one file")
        if os.path.exists(self.dst) and not overwrite:
            raise CheckpointExistsError(f"{self.dst} exists; pass overwrite=True to replace it")
        parent = os.path.dirname(self.dst)
        os.makedirs(parent, exist_ok=True)
        self.tmp = os.path.join(parent, f".{os.path.basename(self.dst)}.tmp-{uuid.uuid4().hex[:12]}")
        self.fh: Any = None
        self.slots: dict[int, tuple[int, tuple[int, ...]]] = {}  # id(item) -> (data offset, CRC positions)
        self.crc = 0

    def begin(self, items: list[tuple[Any, tuple, tuple | None, Any]]) -> None:
        """``items``: (handle, key path, containers, fake-tensor spec (shape, DType) | value)."""
        torch = _torch()
        from torch.serialization import skip_data

        try:
            from torch._subclasses.fake_tensor import FakeTensorMode
        except ImportError:  # pragma: no cover
            raise ImportError("writing torch.save files with bounded memory needs torch's FakeTensorMode") from None
        from .common import nest

        fakes = []
        with FakeTensorMode():
            entries = []
            for handle, path, containers, spec in items:
                if isinstance(spec, _TensorSpec):
                    t = torch.empty(spec.shape, dtype=zdt.torch_dtype(spec.dtype))
                    fakes.append((handle, path))
                    entries.append((path, containers, t))
                else:
                    entries.append((path, containers, spec))
            obj = nest(entries)
        with skip_data(materialize_fake_tensors=True):
            torch.save(obj, self.tmp)
        meta = torch.load(self.tmp, map_location="meta", weights_only=True)
        loaded = {p: v for p, _, v in walk(meta)}
        with open(self.tmp, "rb") as fh:
            zf = zipfile.ZipFile(fh)
            cd = _central_entries(fh, zf)
            by_data = {}
            for info in zf.infolist():
                fh.seek(info.header_offset)
                head = fh.read(30)
                n, e = struct.unpack("<HH", head[26:30])
                flags = struct.unpack("<H", head[6:8])[0]
                data = info.header_offset + 30 + n + e
                crc_at = [cd[info.filename] + 16]  # the central directory entry's CRC
                if flags & 0x08:  # a data descriptor follows the data: [signature] CRC sizes
                    fh.seek(data + info.file_size)
                    crc_at.append(data + info.file_size + (4 if fh.read(4) == b"PK\x07\x08" else 0))
                else:
                    crc_at.append(info.header_offset + 14)  # the local header's CRC
                by_data[data] = tuple(crc_at)
        for handle, path in fakes:
            off = loaded[path].untyped_storage()._checkpoint_offset
            self.slots[id(handle)] = (off, by_data[off])
        self.fh = open(self.tmp, "r+b")

    def write_array(self, handle: Any, pieces: Iterator[tuple[tuple, np.ndarray]]) -> None:
        off, crc_at = self.slots[id(handle)]
        self.fh.seek(off)
        crc = 0
        for _, data in pieces:
            mv = memoryview(np.require(data, requirements="C").reshape(-1).view(np.uint8))
            self.fh.write(mv)
            crc = zlib.crc32(mv, crc)
        for pos in crc_at:
            self.fh.seek(pos)
            self.fh.write(struct.pack("<I", crc))

    def commit(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.dst)

    def abandon(self) -> None:
        if self.fh is not None:
            self.fh.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


_MAX_INT_BYTES = 255  # pickle's LONG1, the only long integer torch's weights_only unpickler reads


def unloadable_int(value: Any) -> int | None:
    """An integer in ``value`` (descending into lists, tuples and dicts) that
    ``torch.load(weights_only=True)`` refuses to read back (more than 255 bytes in two's
    complement, about 614 decimal digits), or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        magnitude = value if value >= 0 else ~value
        return value if magnitude.bit_length() // 8 + 1 > _MAX_INT_BYTES else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for v in items:
        found = unloadable_int(v)
        if found is not None:
            return found
    return None


class _TensorSpec:
    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: zdt.DType) -> None:
        self.shape, self.dtype = shape, dtype


def tensor_spec(shape: tuple[int, ...], dtype: zdt.DType) -> _TensorSpec:
    return _TensorSpec(shape, dtype)


def _central_entries(fh: Any, zf: zipfile.ZipFile) -> dict[str, int]:
    """File name -> offset of its central directory entry."""
    out = {}
    pos = zf.start_dir
    for _ in zf.infolist():
        fh.seek(pos)
        head = fh.read(46)
        if head[:4] != b"PK\x01\x02":
            raise FormatError("unexpected zip central directory layout")
        n, e, c = struct.unpack("<HHH", head[28:34])
        name = fh.read(n).decode("utf-8")
        out[name] = pos
        pos += 46 + n + e + c
    return out


__all__ = ["Sink", "Source", "TensorFile", "View", "expand", "load_meta", "refusal", "tensor_spec",
           "unloadable_int", "walk"]
