"""A zarrckpt checkpoint as a converter source (torch-free): the leaves of its tree, each
array (packed or not) read box by box through the checkpoint's read primitive."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import numpy as np

from ..format import tree as ztree
from ..readers.checkpoint import Checkpoint
from ..storage import StorageOptions
from .common import ArrayLeaf, ValueLeaf

__all__ = ["Source"]

_KINDS = {"tensor": "tensor", "dtensor": "tensor", "sharded_tensor": "tensor", "ndarray": "ndarray",
          "bytes": "bytes", "bytesio": "bytesio"}


class Source:
    def __init__(self, src: str | os.PathLike, storage: StorageOptions | None = None) -> None:
        self.ckpt = Checkpoint(src, storage)
        self.metadata = self.ckpt.info.metadata

    def leaves(self) -> Iterator[ArrayLeaf | ValueLeaf]:
        for path, containers, node in _walk(self.ckpt.info.tree, (), ()):
            ((kind, body),) = node.items()
            key = ztree.key_of(path)
            if kind in ("array", "packed"):
                info = self.ckpt.array_info(key)
                yield ArrayLeaf(path, info.shape, info.dtype, functools.partial(self._read, key),
                                _KINDS.get(info.kind, "tensor"), containers)
            elif kind == "json":
                yield ValueLeaf(path, body, containers)
            elif kind == "float":
                yield ValueLeaf(path, float(body), containers)
            elif kind in ("dict", "list", "tuple"):  # an empty container
                yield ValueLeaf(path, {"dict": {}, "list": [], "tuple": ()}[kind], containers)
            else:  # pragma: no cover - parse_tree refused it already
                raise AssertionError(kind)

    def _read(self, key: str, box: tuple) -> np.ndarray:
        return self.ckpt.read_box(key, box)

    def close(self) -> None:
        pass


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
