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

    def __init__(self, directory: str, documents: dict, crc_tables: dict, content: dict,
                 bucket: str | None = None, check: Checkpoint | None = None) -> None:
        self.directory = directory  # a directory, or (S3) the key prefix in ``bucket``
        self.bucket = bucket
        self.documents = documents
        self.crc_tables = crc_tables
        self.content = content
        self._check = check  # S3: PREV, re-read after the copies (confirm)
        self.tried: list[int] = []  # S3: bytes of every copy attempted (appended by the copier)
        self._arrays: dict[str, PreviousArray | None] = {}

    @classmethod
    def open(cls, path: Any, storage_options: Any = None, target: Any = None) -> Previous | None:
        """PREV's root, or None (with a warning: the save then writes everything) where
        nothing can be linked or copied from it: not a committed checkpoint, not on a local or
        parallel file system nor in the S3 bucket ``target`` (the save's storage) writes to,
        before format 1.3, or no content hashes recorded."""
        try:
            ck = Checkpoint(path, storage_options)
        except Exception as e:  # noqa: BLE001 - an incremental save still saves
            log.warning("zarrckpt: incremental_from=%r cannot be opened (%s); writing every chunk", path, e)
            return None
        directory = getattr(ck.storage, "local_path", None)
        bucket = None
        info = ck.info
        digests = info.raw.get("attributes", {}).get("zarrckpt", {}).get("digests") or {}
        content = digests.get("content")
        why = None
        spec = getattr(ck.storage, "_spec", None) or {}
        tspec = getattr(target, "_spec", None) or {}
        if directory is None and spec.get("driver") == "s3" and target is not None:
            if (tspec.get("driver"), tspec.get("bucket"), tspec.get("endpoint")) != \
                    ("s3", spec["bucket"], spec.get("endpoint")):
                why = "it is on S3 and the save is not in the same bucket of the same endpoint"
            elif target.enable_copies() is None:
                why = "server-side copies are not available (see the warning before)"
            else:
                directory, bucket = spec.get("path", "").rstrip("/"), spec["bucket"]
        elif directory is None:
            why = "it is not on a local or parallel file system"
        elif target is not None and getattr(target, "local_path", None) is None:
            why = "it is on a file system and the save is not"
        if why is None and (info.chunk_tables is None or info.consolidated is None):
            why = f"it is format {info.version} (chunk positions start with 1.3)"
        elif why is None and not (isinstance(content, dict) and content.get("algorithm") == fmt.CONTENT_ALGORITHM
                                  and isinstance(content.get("chunks"), dict)):
            why = "its root records no content hashes (save it with content_hashes=True)"
        if why is not None:
            log.warning("zarrckpt: nothing can be linked from %s: %s; writing every chunk", ck.url, why)
            return None
        return cls(directory if bucket is not None else os.path.realpath(directory), dict(info.consolidated),
                   dict(info.chunk_tables), dict(content["chunks"]), bucket, ck if bucket is not None else None)

    def confirm(self) -> None:
        """After every chunk was written or copied, before the commit: on S3, PREV must still
        be the checkpoint whose records were compared (copies are of whatever its keys hold
        when made; a PREV deleted meanwhile failed them and they were written). Raises where
        another save replaced it; links on file systems need no check (they are of inodes)."""
        if self._check is None or not self.tried:
            return
        try:
            self._check.check_unchanged()
        except Exception as e:
            from ..errors import StorageError

            raise StorageError(
                f"incremental_from={self._check.url!r} changed while this save copied chunks from it "
                f"({e}); copied chunks may not hold this save's values, so nothing was committed: save "
                "again (from the new checkpoint, or without incremental_from)") from e

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
        array = PreviousArray(os.path.join(self.directory, *key.split("/")) if self.bucket is None
                              else "/".join(p for p in (self.directory, key.strip("/")) if p), doc,
                              np.frombuffer(content, np.uint8).reshape(*grid, HASH_BYTES),
                              np.frombuffer(crcs, "<u4").reshape(units))
        array.bucket, array.tried = self.bucket, self.tried
        return array
