"""A zarrckpt checkpoint as a converter source (torch-free): the leaves of its tree, each
array read box by box through TensorStore."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..format import documents as fmt
from ..format import tree as ztree
from ..storage.inflight import wait_all
from ..readers.checkpoint import Checkpoint
from ..storage import StorageOptions
from .common import ArrayLeaf, ValueLeaf, in_memory_leaf

_KINDS = {"tensor": "tensor", "dtensor": "tensor", "sharded_tensor": "tensor", "ndarray": "ndarray",
          "bytes": "bytes", "bytesio": "bytesio"}


class Source:
    def __init__(self, src: str | os.PathLike, storage: StorageOptions | None = None) -> None:
        self.ckpt = Checkpoint(src, storage)
        self.metadata = self.ckpt.info.metadata
        self._open: tuple[str, Any] | None = None

    def leaves(self) -> Iterator[ArrayLeaf | ValueLeaf]:
        for path, containers, node in _walk(self.ckpt.info.tree, (), ()):
            ((kind, body),) = node.items()
            key = ztree.key_of(path)
            if kind == "array":
                info = self.ckpt.array_info(key)
                yield ArrayLeaf(path, info.shape, info.dtype, self._reader(key, info),
                                _KINDS.get(info.kind, "tensor"), containers)
            elif kind == "packed":
                value = self.ckpt.read(key)
                leaf_kind = body["kind"]
                data = np.frombuffer(value, np.uint8) if isinstance(value, bytes) else value
                yield in_memory_leaf(path, data, leaf_kind, containers)
            elif kind == "json":
                yield ValueLeaf(path, body, containers)
            elif kind == "float":
                yield ValueLeaf(path, float(body), containers)
            elif kind in ("dict", "list", "tuple"):  # an empty container
                yield ValueLeaf(path, {"dict": {}, "list": [], "tuple": ()}[kind], containers)
            else:  # pragma: no cover - parse_tree refused it already
                raise AssertionError(kind)

    def _reader(self, key: str, info: fmt.ArrayInfo):
        def read(box: tuple) -> np.ndarray:
            out = np.empty([b - a for a, b in box], dtype=info.dtype.numpy)
            if out.size:
                if self._open is None or self._open[0] != key:
                    self._open = (key, self.ckpt.open_array(key))
                wait_all([(key, self._open[1].read_into(tuple(box), out))])
            return out

        return read

    def close(self) -> None:
        self._open = None


def _walk(node: dict, path: tuple, containers: tuple) -> Iterator[tuple[tuple, tuple, dict]]:
    """Leaves of a stored tree with the kinds of the containers above them; a ``json`` node
    is one leaf (its whole value), unlike ``Checkpoint.keys()``."""
    ((kind, body),) = node.items()
    if kind in ("dict", "list", "tuple") and (body or not path):
        items = body if kind == "dict" else list(enumerate(body))
        for k, sub in items:
            yield from _walk(sub, path + (k,), containers + ((kind,) if path else ()))
        return
    yield path, containers, node
