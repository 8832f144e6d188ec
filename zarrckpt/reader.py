"""Reading a checkpoint without torch: ``zarrckpt.open(path)``.

>>> ckpt = zarrckpt.open("ckpt/step_100")          # doctest: +SKIP
>>> ckpt.keys()[:2]                                 # doctest: +SKIP
['model/layer.bias', 'model/layer.weight']
>>> ckpt.read("model/layer.weight").dtype           # doctest: +SKIP
dtype(bfloat16)
>>> ckpt.tensorstore("model/layer.weight")[0:8].read().result()  # lazy slice  # doctest: +SKIP

Every document is verified before it is used (spec §6.6): the root against its own
digest, each array ``zarr.json`` against the digest the root records, and both parsed
strictly (:mod:`zarrckpt.format`). On a local file system, files that are not regular
files (a FIFO, a device) are refused before anything opens them, so a damaged or
hostile directory cannot hang a reader.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from . import format as fmt
from . import tree as ztree
from ._io import wait_all
from .errors import CheckpointNotFoundError, FormatError
from .storage import Array, Storage, StorageOptions, in_memory_array, storage_error, translate_error

__all__ = ["Checkpoint", "open_checkpoint"]


class Checkpoint:
    """A committed checkpoint, opened for reading. Holds no data until asked."""

    def __init__(self, path: str | os.PathLike, storage_options: StorageOptions | None = None) -> None:
        self.storage = Storage(path, storage_options)
        self.url = self.storage.url
        _refuse_plain_file(self.storage)
        data = self._read_document("zarr.json", "the root")
        if data is None:
            raise CheckpointNotFoundError(_not_found_message(self.storage))
        self.info = fmt.parse_root_bytes(data, self.url)
        self._leaves: dict[str, tuple[ztree.KeyPath, dict]] = {
            key: (kp, node) for kp, key, node in self.info.leaves}
        self._arrays: dict[str, fmt.ArrayInfo] = {}
        self._packs: dict[str, np.ndarray] = {}
        self._checked_files: set[str] = set()

    # ---- keys ---------------------------------------------------------------

    def keys(self) -> list[str]:
        """Every leaf key (arrays and values), in stored order."""
        return list(self._leaves)

    def array_keys(self) -> list[str]:
        """Keys whose values are arrays (stored as their own array, or packed)."""
        return [k for k, (_, n) in self._leaves.items() if "array" in n or "packed" in n]

    def __contains__(self, key: object) -> bool:
        return key in self._leaves

    def __iter__(self) -> Iterator[str]:
        return iter(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)

    def node(self, key: str) -> dict:
        try:
            return self._leaves[key][1]
        except KeyError:
            raise KeyError(f"no key {key!r} in checkpoint {self.url!r}") from None

    def is_array(self, key: str) -> bool:
        node = self.node(key)
        return "array" in node or "packed" in node

    def is_packed(self, key: str) -> bool:
        return "packed" in self.node(key)

    # ---- metadata -----------------------------------------------------------

    def array_info(self, key: str) -> fmt.ArrayInfo:
        return self.array_infos([key])[key]

    def array_infos(self, keys: Iterable[str]) -> dict[str, fmt.ArrayInfo]:
        """Parsed and verified ``zarr.json`` of many arrays, read concurrently and cached.
        A packed leaf's info comes from its tree node (its pack is checked when read)."""
        keys = list(keys)
        todo = [k for k in keys if k not in self._arrays]
        futures = []
        for k in todo:
            node = self.node(k)
            if "packed" in node:
                self._arrays[k] = fmt.parse_packed(node["packed"], k)
                continue
            if "array" not in node:
                raise KeyError(f"{k!r} is a value, not an array")
            self._check_files(k, k)
            futures.append((k, self.storage.kv.read(f"{k}/zarr.json")))
        for k, f in futures:
            self._arrays[k] = self._parse_array(k, k, _result_bytes(f, f"{self.url}/{k}/zarr.json"),
                                                pack=False)
        return {k: self._arrays[k] for k in keys}

    def _parse_array(self, key: str, path: str, data: bytes | None, *, pack: bool) -> fmt.ArrayInfo:
        doc = None
        if data is not None:
            fmt.check_array_digest(self.info, path, data, key)
            doc = fmt.decode_document(data, f"array {key!r}: {path}/zarr.json")
        return fmt.parse_array(doc, key, self.info.save_id, path=path, pack=pack)

    def _read_document(self, key: str, what: str) -> bytes | None:
        local = self.storage.local_path
        if local is not None:
            _require_regular(os.path.join(local, key), f"{self.url}: {what} {key}", missing_ok=True)
        data, _ = self.storage.read_bytes(key)
        return data

    def _check_files(self, path: str, key: str) -> None:
        """Local file systems: ``<path>/zarr.json`` and every chunk file of the array must be
        regular files (a FIFO or a device would hang or never end a read)."""
        local = self.storage.local_path
        if local is None or path in self._checked_files:
            return
        base = os.path.join(local, path)
        _require_regular(os.path.join(base, "zarr.json"), f"array {key!r}: zarr.json", missing_ok=True)
        stack = [os.path.join(base, "c")]
        while stack:
            p = stack.pop()
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue  # missing chunks are reported when read
            except OSError as e:
                raise storage_error(f"array {key!r}: cannot inspect {p}", e) from e
            if stat.S_ISDIR(st.st_mode):
                if p.count(os.sep) - base.count(os.sep) > fmt.MAX_RANK + 1:
                    raise FormatError(f"array {key!r}: chunk directories nest deeper than any chunk key")
                with os.scandir(p) as it:
                    stack.extend(e.path for e in it)
            elif not stat.S_ISREG(st.st_mode):
                raise FormatError(f"array {key!r}: {p} is not a regular file ({_file_type(st.st_mode)}); "
                                  "a chunk must be a regular file")
        self._checked_files.add(path)

    # ---- data ---------------------------------------------------------------

    def open_array(self, key: str) -> Array:
        if self.is_packed(key):
            raise ValueError(f"{key!r} is packed inside {self.node(key)['packed']['pack']!r}; use read() "
                             "or tensorstore()")
        info = self.array_info(key)
        try:
            return Array(self.storage.open_for_read(key, info.metadata).result(), key)
        except Exception as e:  # noqa: BLE001
            raise translate_error(e, key) from e

    def tensorstore(self, key: str) -> Any:
        """A TensorStore handle of an array leaf, for lazy slicing.

        An array of its own is opened from storage (nothing is read until sliced). A packed
        leaf is small (``pack_bytes`` at most): its bytes are read from its pack and returned
        as an in-memory, read-only TensorStore array of its data type and shape."""
        if self.is_packed(key):
            value = self.read(key)
            if isinstance(value, bytes):
                value = np.frombuffer(value, np.uint8)
            return in_memory_array(value)
        return self.open_array(key)._ts

    def read(self, key: str) -> Any:
        """One leaf: an ndarray (ml_dtypes for bf16/fp8), ``bytes``, or the stored value."""
        node = self.node(key)
        if "packed" in node:
            return self._read_packed(node["packed"], key)
        if "array" not in node:
            return ztree.decode_tree(node, _no_array, key)
        info = self.array_info(key)
        out = np.empty(info.shape, dtype=info.dtype.numpy)
        if out.size:
            wait_all([(key, self.open_array(key).read_into(tuple((0, s) for s in info.shape), out))])
        return out.tobytes() if info.kind in fmt.BYTE_KINDS else out

    def _read_packed(self, desc: dict, key: str) -> Any:
        """A packed leaf: its bytes of the pack array (each pack is read once, then cached)."""
        info = fmt.parse_packed(desc, key)
        path = desc["pack"]
        pack = self._packs.get(path)
        if pack is None:
            self._check_files(path, key)
            pinfo = self._parse_array(key, path, self._read_document(f"{path}/zarr.json", f"pack of {key!r}"),
                                      pack=True)
            pack = np.empty(pinfo.shape, dtype=np.uint8)
            if pack.size:
                try:
                    arr = Array(self.storage.open_for_read(path, pinfo.metadata).result(), path)
                except Exception as e:  # noqa: BLE001
                    raise translate_error(e, path) from e
                wait_all([(path, arr.read_into(((0, pinfo.shape[0]),), pack))])
            self._packs[path] = pack
        start, n = desc["offset"], desc["nbytes"]
        if start + n > pack.shape[0]:
            raise FormatError(f"packed leaf {key!r}: bytes {start}..{start + n} outside pack "
                              f"{path!r} of {pack.shape[0]} bytes")
        raw = pack[start:start + n]
        if info.kind in fmt.BYTE_KINDS:
            return raw.tobytes()
        return raw.copy().view(info.dtype.numpy).reshape(info.shape)

    def to_dict(self, keys: Iterable[str] | None = None,
                load_array: Callable[[str], Any] | None = None) -> dict:
        """The nested state dict (or the part under ``keys``: exact keys or prefixes)."""
        tree = self.info.tree if keys is None else self._prune(list(keys))
        by_packed = {id(n["packed"]): k for k, (_, n) in self._leaves.items() if "packed" in n}

        def leaf(body: Any) -> Any:
            key = by_packed[id(body)] if isinstance(body, dict) else body  # an array node: its key
            return (load_array or self.read)(key)

        return ztree.decode_tree(tree, leaf)

    def _prune(self, wanted: list[str]) -> dict:
        for w in wanted:
            if not any(k == w or k.startswith(w + "/") for k in self._leaves):
                raise KeyError(f"no key {w!r} (nor keys under it) in checkpoint {self.url!r}")

        def keep(path: ztree.KeyPath) -> bool:
            k = ztree.key_of(path)
            return any(k == w or k.startswith(w + "/") or w.startswith(k + "/") for w in wanted)

        def walk(node: dict, path: ztree.KeyPath) -> dict | None:
            ((kind, body),) = node.items()
            if kind == "dict":
                items = [[k, sub] for k, v in body if keep(path + (k,))
                         for sub in [walk(v, path + (k,))] if sub is not None]
                return {"dict": items}
            return node

        return walk(self.info.tree, ())

    def __repr__(self) -> str:
        return f"<zarrckpt.Checkpoint {self.url!r}: {len(self)} keys, saved {self.info.created}>"


def _no_array(key: str) -> Any:  # pragma: no cover - values never hold arrays
    raise FormatError(f"value node refers to array {key!r}")


def _result_bytes(future: Any, where: str) -> bytes | None:
    try:
        r = future.result()
    except ValueError as e:
        raise storage_error(f"reading {where}", e) from e
    return bytes(r.value) if r.state == "value" else None


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _require_regular(path: str, what: str, *, missing_ok: bool) -> None:
    """``path`` (symlinks followed) is a regular file, or absent when ``missing_ok``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    except NotADirectoryError:
        return  # a parent is a file: the read reports it missing
    except OSError as e:
        raise storage_error(f"{what}: cannot inspect {path}", e) from e
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{what} ({path}) is {_file_type(st.st_mode)}, not a regular file")


# ------------------------------------------------------------------ not a checkpoint

_CONVERTER = "a converter is planned (`zarrckpt convert`, issue 11)"
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def _refuse_plain_file(storage: Storage) -> None:
    """A local path that is a file is never a checkpoint (a checkpoint is a directory)."""
    local = storage.local_path
    if local is None:
        return
    path = local.rstrip("/") or "/"
    if os.path.isfile(path):
        raise CheckpointNotFoundError(f"{storage.url!r} is {_file_kind(path)}, not a zarrckpt "
                                      "checkpoint (a checkpoint is a directory with a zarr.json)")


def _file_kind(path: str) -> str:
    name = os.path.basename(path)
    if name.endswith(".safetensors"):
        return f"a safetensors file; {_CONVERTER}"
    if name.endswith(_TORCH_SUFFIXES):
        return f"a torch.save file; {_CONVERTER}"
    return "a file"


def _not_found_message(storage: Storage) -> str:
    """Why there is no checkpoint at the location, naming what is there instead if it is a
    format people confuse with this one."""
    def has(key: str) -> bool:
        local = storage.local_path
        if local is not None:
            return os.path.exists(os.path.join(local, key))
        try:
            return storage.read_bytes(key)[0] is not None
        except Exception:  # noqa: BLE001 - only a hint
            return False

    url = storage.url
    if has(".metadata"):
        return (f"{url!r} is a PyTorch Distributed Checkpoint (DCP) directory (it has a .metadata "
                f"file), not a zarrckpt checkpoint; {_CONVERTER}")
    local = storage.local_path
    names = []
    if local is not None and os.path.isdir(local):
        try:
            names = sorted(os.listdir(local))
        except OSError:
            names = []
    if has("model.safetensors") or has("model.safetensors.index.json") or any(
            n.endswith(".safetensors") for n in names):
        return f"{url!r} holds safetensors files, not a zarrckpt checkpoint; {_CONVERTER}"
    torch_files = [n for n in names if n.endswith(_TORCH_SUFFIXES)]
    if torch_files:
        return (f"no zarrckpt checkpoint at {url!r} (no zarr.json); it holds torch.save files "
                f"({', '.join(torch_files[:3])}); {_CONVERTER}")
    return f"no zarrckpt checkpoint at {url!r} (no zarr.json)"


def open_checkpoint(path: str | os.PathLike, **storage_options: Any) -> Checkpoint:
    """Open a committed checkpoint for reading (no torch needed)."""
    return Checkpoint(path, StorageOptions(**storage_options) if storage_options else None)
