"""The previous checkpoint of an incremental save (``save(incremental_from=...)``, spec
§7.9), as one rank sees it: read from its root once; which of its arrays' chunk files a
new save may link (:class:`zarrckpt.storage.content.PreviousArray`)."""

from __future__ import annotations

import binascii
import logging
import math
import os
from typing import Any

import numpy as np

from ..format import documents as fmt
from ..storage.content import HASH_BYTES, PreviousArray
from .checkpoint import Checkpoint


def content_tables(ck: Checkpoint, path: str) -> tuple[str, str] | None:
    """The recorded content hashes (spec §6.6.2) and unit CRC-32Cs (§6.6.1) of the array at
    ``path``, as stored (base64), or None where the root has not both."""
    digests = ck.info.raw.get("attributes", {}).get("zarrckpt", {}).get("digests") or {}
    content = digests.get("content")
    if not (isinstance(content, dict) and content.get("algorithm") == fmt.CONTENT_ALGORITHM
            and isinstance(content.get("chunks"), dict)):
        return None
    hashes, crcs = content["chunks"].get(path), (ck.info.chunk_tables or {}).get(path)
    return None if not isinstance(hashes, str) or not isinstance(crcs, str) else (hashes, crcs)


def same_content(a: Checkpoint, b: Checkpoint, path: str) -> bool:
    """True when both roots record, for the array at ``path``, the same chunk-file-deciding
    metadata, content hashes and unit CRC-32Cs: the same values, known without reading a
    chunk (the two checks of spec §7.9). False means "unknown", not "different"."""
    ta, tb = content_tables(a, path), content_tables(b, path)
    da = (a.info.consolidated or {}).get(path)
    db = (b.info.consolidated or {}).get(path)
    if ta is None or ta != tb or not isinstance(da, dict) or not isinstance(db, dict):
        return False
    return all(da.get(k) == db.get(k) for k in SAME_BYTES_MEMBERS)

log = logging.getLogger("zarrckpt")

__all__ = ["Previous", "SAME_BYTES_MEMBERS", "content_tables", "same_content"]

# the members of an array's zarr.json that decide its chunk files' bytes (spec §5.1); the
# attributes (save ids, placements) do not
SAME_BYTES_MEMBERS = ("zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "codecs",
         "fill_value")


class Previous:
    """PREV's directory, array documents, unit CRC tables and content hashes."""

    def __init__(self, directory: str, documents: dict, crc_tables: dict, content: dict) -> None:
        self.directory = directory
        self.documents = documents
        self.crc_tables = crc_tables
        self.content = content
        self._arrays: dict[str, PreviousArray | None] = {}

    @classmethod
    def open(cls, path: Any, storage_options: Any = None) -> Previous | None:
        """PREV's root, or None (with a warning: the save then writes everything) where it
        cannot be linked from: not a committed checkpoint, not on a local or parallel file
        system, before format 1.3, or no content hashes recorded."""
        try:
            ck = Checkpoint(path, storage_options)
        except Exception as e:  # noqa: BLE001 - an incremental save still saves
            log.warning("zarrckpt: incremental_from=%r cannot be opened (%s); writing every chunk", path, e)
            return None
        directory = getattr(ck.storage, "local_path", None)
        info = ck.info
        digests = info.raw.get("attributes", {}).get("zarrckpt", {}).get("digests") or {}
        content = digests.get("content")
        why = None
        if directory is None:
            why = "it is not on a local or parallel file system"
        elif info.chunk_tables is None or info.consolidated is None:
            why = f"it is format {info.version} (chunk positions start with 1.3)"
        elif not (isinstance(content, dict) and content.get("algorithm") == fmt.CONTENT_ALGORITHM
                  and isinstance(content.get("chunks"), dict)):
            why = "its root records no content hashes (save it with content_hashes=True)"
        if why is not None:
            log.warning("zarrckpt: nothing can be linked from %s: %s; writing every chunk", ck.url, why)
            return None
        return cls(os.path.realpath(directory), dict(info.consolidated), dict(info.chunk_tables),
                   dict(content["chunks"]))

    def array(self, key: str, document: dict) -> PreviousArray | None:
        """PREV's array ``key`` if its chunk files hold the same bytes for the same values
        as ``document`` says (else None: its chunks are written)."""
        if key not in self._arrays:
            self._arrays[key] = self._array(key, document)
        return self._arrays[key]

    def _array(self, key: str, document: dict) -> PreviousArray | None:
        doc = self.documents.get(key)
        if not isinstance(doc, dict) or any(doc.get(k) != document.get(k) for k in SAME_BYTES_MEMBERS):
            return None
        try:
            content = binascii.a2b_base64(self.content[key].encode("ascii"), strict_mode=True)
            crcs = binascii.a2b_base64(self.crc_tables[key].encode("ascii"), strict_mode=True)
        except (KeyError, AttributeError, binascii.Error, ValueError):
            return None
        grid = fmt.chunk_grid_shape(doc)
        units = tuple(fmt.unit_grid(doc))
        if len(content) != HASH_BYTES * math.prod(grid) or len(crcs) != 4 * math.prod(units):
            return None
        return PreviousArray(os.path.join(self.directory, *key.split("/")), doc,
                             np.frombuffer(content, np.uint8).reshape(*grid, HASH_BYTES),
                             np.frombuffer(crcs, "<u4").reshape(units))
