"""Reading a checkpoint without torch: ``zarrckpt.open(path)``.

>>> ckpt = zarrckpt.open("ckpt/step_100")          # doctest: +SKIP
>>> ckpt.keys()[:2]                                 # doctest: +SKIP
['model/layer.bias', 'model/layer.weight']
>>> ckpt.read("model/layer.weight").dtype           # doctest: +SKIP
dtype(bfloat16)
>>> ckpt.tensorstore("model/layer.weight")[0:8].read().result()  # lazy slice  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from . import format as fmt
from . import tree as ztree
from .errors import FormatError
from .storage import Array, Storage, StorageOptions
from .storage._tensorstore import translate_error
from ._io import wait_all

__all__ = ["Checkpoint", "open_checkpoint"]


class Checkpoint:
    """A committed checkpoint, opened for reading. Holds no data until asked."""

    def __init__(self, path: str | os.PathLike, storage_options: StorageOptions | None = None) -> None:
        self.storage = Storage(path, storage_options)
        self.url = self.storage.url
        self.info = fmt.parse_root(self.storage.read_json("zarr.json"), self.url)
        self._leaves: dict[str, tuple[ztree.KeyPath, dict]] = {}
        for path_, node in ztree.tree_keys(self.info.tree):
            self._leaves[ztree.key_of(path_)] = (path_, node)
        self._arrays: dict[str, fmt.ArrayInfo] = {}
        self._packs: dict[str, np.ndarray] = {}

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
        """Parsed ``zarr.json`` of many arrays, read concurrently and cached."""
        keys = list(keys)
        todo = [k for k in keys if k not in self._arrays]
        futures = []
        for k in todo:
            node = self.node(k)
            if "packed" in node:
                self._arrays[k] = fmt.parse_packed(node["packed"], k)
                continue
            array_path = node.get("array")
            if array_path is None:
                raise KeyError(f"{k!r} is a value, not an array")
            futures.append((k, self.storage.kv.read(f"{array_path}/zarr.json")))
        for k, f in futures:
            r = f.result()
            doc = None
            if r.state == "value":
                try:
                    doc = json.loads(r.value)
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise FormatError(f"array {k!r}: zarr.json is not valid JSON: {e}") from None
            self._arrays[k] = fmt.parse_array(doc, k, self.info.save_id)
        return {k: self._arrays[k] for k in keys}

    # ---- data ---------------------------------------------------------------

    def open_array(self, key: str) -> Array:
        if self.is_packed(key):
            raise ValueError(f"{key!r} is packed inside {self.node(key)['packed']['pack']!r}; use read()")
        info = self.array_info(key)
        try:
            return Array(self.storage.open_for_read(self.node(key)["array"], info.metadata).result(), key)
        except Exception as e:  # noqa: BLE001
            raise translate_error(e, key) from e

    def tensorstore(self, key: str) -> Any:
        """The TensorStore handle of an array, for lazy slicing."""
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
        wait_all([(key, self.open_array(key).read_into(tuple((0, s) for s in info.shape), out))])
        return out.tobytes() if info.kind == "bytes" else out

    def _read_packed(self, desc: dict, key: str) -> Any:
        """A packed leaf: its bytes of the pack array (each pack is read once, then cached)."""
        info = fmt.parse_packed(desc, key)
        pack = self._packs.get(desc["pack"])
        if pack is None:
            doc = self.storage.read_json(f"{desc['pack']}/zarr.json")
            pinfo = fmt.parse_array(doc, desc["pack"], self.info.save_id)
            if pinfo.kind != "pack" or pinfo.dtype.zarr != "uint8" or len(pinfo.shape) != 1:
                raise FormatError(f"packed leaf {key!r}: {desc['pack']!r} is not a 1-D uint8 pack array")
            pack = np.empty(pinfo.shape, dtype=np.uint8)
            arr = Array(self.storage.open_for_read(desc["pack"], pinfo.metadata).result(), desc["pack"])
            wait_all([(desc["pack"], arr.read_into(((0, pinfo.shape[0]),), pack))])
            self._packs[desc["pack"]] = pack
        start, n = desc["offset"], desc["nbytes"]
        if start < 0 or start + n > pack.shape[0]:
            raise FormatError(f"packed leaf {key!r}: bytes {start}..{start + n} outside pack "
                              f"{desc['pack']!r} of {pack.shape[0]} bytes")
        raw = pack[start:start + n]
        if info.kind == "bytes":
            return raw.tobytes()
        return raw.copy().view(info.dtype.numpy).reshape(info.shape)

    def to_dict(self, keys: Iterable[str] | None = None,
                load_array: Callable[[str], Any] | None = None) -> dict:
        """The nested state dict (or the part under ``keys``: exact keys or prefixes)."""
        tree = self.info.tree if keys is None else self._prune(list(keys))
        by_array = {n["array"]: k for k, (_, n) in self._leaves.items() if "array" in n}
        by_packed = {id(n["packed"]): k for k, (_, n) in self._leaves.items() if "packed" in n}

        def leaf(body: Any) -> Any:
            key = by_packed[id(body)] if isinstance(body, dict) else by_array[body]
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


def open_checkpoint(path: str | os.PathLike, **storage_options: Any) -> Checkpoint:
    """Open a committed checkpoint for reading (no torch needed)."""
    return Checkpoint(path, StorageOptions(**storage_options) if storage_options else None)

