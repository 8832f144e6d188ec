"""Content hashes of chunks and hard links for incremental saves (spec §6.6.2, §7.9).

A save that records content hashes computes, per chunk written by the direct local-file
path or the small-file path, the XXH3-128 of the chunk's decoded units in C order (the
bytes a reader decodes, padding included). An incremental save compares each chunk it is
about to write with the previous checkpoint's (:class:`PreviousArray`, made by
``zarrckpt.readers.previous``): same array metadata, same content hash **and** the same
CRC-32C of every unit (spec §6.6.1's table). Only then is the chunk file hard-linked
instead of written. Two independent checks must collide (128-bit XXH3 and one 32-bit
CRC-32C per unit) before different bytes could be linked; a test replaces
:data:`chunk_hash` with a double that always collides and shows the CRC check alone keeps
such chunks written.

Local and parallel file systems link (``os.link``; another file system or a refused link
falls back to writing the chunk). Arrays written through TensorStore (compressed arrays,
object stores) record their hashes too (``_tensorstore.TensorStoreArray._write_recorded``);
on S3 an unchanged chunk of such an array is copied server-side from the previous
checkpoint when it is in the same bucket (``storage/s3copy.py``); elsewhere they are written.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import xxhash

from ..format import documents as fmt

log = logging.getLogger("zarrckpt")

__all__ = ["HASH_BYTES", "PreviousArray", "chunk_hash", "count", "counters", "fsync_path", "link", "xxh3_128"]

HASH_BYTES = 16


def xxh3_128(bodies: Iterable[Any]) -> bytes:
    """XXH3-128 (seed 0) of the concatenated ``bodies``, its 16-byte canonical (big-endian) form."""
    h = xxhash.xxh3_128()
    for b in bodies:
        h.update(b)
    return h.digest()


chunk_hash = xxh3_128  # tests replace it with a double that always collides

# linked on file systems; copied server-side on S3 (s3copy.py)
_counts = {"chunks_linked": 0, "bytes_linked": 0, "link_failures": 0, "chunks_copied": 0, "bytes_copied": 0,
           "copy_failures": 0}
_counts_lock = threading.Lock()


def counters() -> dict[str, int]:
    """Chunks and data bytes this process linked (or, on S3, copied) instead of writing
    (since start), and links refused (copies failed)."""
    with _counts_lock:
        return dict(_counts)


def count(**kw: int) -> None:
    with _counts_lock:
        for k, v in kw.items():
            _counts[k] += v


class PreviousArray:
    """One array of the previous checkpoint whose chunk files may be linked: its directory,
    the content hash of each chunk (chunk grid + 16 bytes) and the CRC-32C of each unit
    (the unit grid)."""

    def __init__(self, directory: str, doc: dict, hashes: np.ndarray, crcs: np.ndarray) -> None:
        self.directory = directory
        self.hashes = hashes
        self.crcs = crcs
        self.per = tuple(c // n for c, n in zip(doc["chunk_grid"]["configuration"]["chunk_shape"],
                                                fmt.unit_shape(doc)))
        self.separator = doc["chunk_key_encoding"].get("configuration", {}).get("separator", "/")

    bucket: str | None = None  # S3: the bucket ``directory`` (then a key prefix) is in
    tried: list[int] | None = None  # S3: the bytes of every copy attempted (shared by the save's arrays)

    def path(self, index: tuple[int, ...]) -> str:
        return os.path.join(self.directory, self.separator.join(["c", *map(str, index)]))

    def object_key(self, index: tuple[int, ...]) -> str:
        """S3: chunk ``index``'s key in :attr:`bucket`."""
        return "/".join(p for p in (self.directory, self.separator.join(["c", *map(str, index)])) if p)

    def chunk_crcs(self, index: tuple[int, ...]) -> np.ndarray:
        """The CRC-32Cs recorded for the units of chunk ``index`` (its part of the unit grid)."""
        return self.crcs[tuple(slice(i * p, (i + 1) * p) for i, p in zip(index, self.per))]

    def matches(self, index: tuple[int, ...], digest: bytes, unit_crcs: np.ndarray) -> bool:
        """Same content hash and the same CRC-32C for every unit of chunk ``index``."""
        if bytes(self.hashes[index]) != digest:
            return False
        prev = self.chunk_crcs(index)
        return prev.shape == unit_crcs.shape and bool(np.array_equal(prev, unit_crcs))


    def plain_link(self, index: tuple[int, ...], digest: bytes) -> tuple[str, int] | None:
        """For a chunk that is its own unit (unsharded): ``(its file, its unit CRC-32C)`` when
        its content hash equals ``digest``, for the writer to compare the CRC-32C it computes
        (spec §7.9 check 4) before it links; else None."""
        if bytes(self.hashes[index]) != digest:
            return None
        crcs = self.chunk_crcs(index).reshape(-1)
        return (self.path(index), int(crcs[0])) if crcs.size == 1 else None


def fsync_path(path: str) -> None:
    """Make a file's (or a directory's) data and metadata durable: open, fsync, close."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link(src: str, dst: str, dirs: set[str] | None = None) -> bool:
    """Hard-link ``src`` at ``dst`` (its directory made first). False where the file system
    refuses (another device, no links, ``src`` gone): the caller writes the chunk."""
    parent = os.path.dirname(dst)
    try:
        if dirs is None or parent not in dirs:
            os.makedirs(parent, exist_ok=True)
            if dirs is not None:
                dirs.add(parent)
        os.link(src, dst)
        return True
    except OSError as e:
        count(link_failures=1)
        log.debug("zarrckpt: linking %s failed (%s); writing it", src, e)
        return False
