"""Storage: the only package that imports TensorStore.

Everything zarrckpt puts on or reads from storage goes through the interface
:class:`Storage` (``base.py``): small documents by key (``zarr.json`` files, the commit
write), listings, the location as a whole, and :class:`Array` regions (chunk writes,
region reads). :func:`open_storage` gives the implementation for a URL (spec §3):

==========================  ===============================================
``/abs/path``, ``rel/path``  local file system (TensorStore ``file`` driver)
``file:///abs/path``         the same
``memory://name``            in-process memory (tests)
``s3://bucket/prefix``       S3; ``AWS_ENDPOINT_URL``/``AWS_REGION`` honoured
``gs://bucket/prefix``       Google Cloud Storage
==========================  ===============================================

and returns a :class:`Storage` it is given as it is, so every public function that takes
a checkpoint path also takes a Storage: :class:`FaultStorage` (``memory.py``) is the one
tests pass, to make storage slow, failing, truncating or dying mid-save.

Errors of the store become :class:`~zarrckpt.errors.StorageError` (full disk,
read-only, permission, unreachable endpoint) or
:class:`~zarrckpt.errors.CorruptChunkError` (missing or damaged chunk), decided by
TensorStore's status code (:func:`translate_error`).
"""

import os

from ._tensorstore import (
    StorageOptions,
    TensorStoreStorage,
    in_memory_array,
    io_counters,
    kvstore_spec,
    status_code,
    storage_error,
    translate_error,
)
from ._localfile import ChunkCodec, ReadBatch, check_index, chunk_codec, file_type, inner_offset, misplaced, release_buffers
from .base import Array, Storage, plain_body, tile_grid
from .memory import FaultStorage

__all__ = ["Array", "ChunkCodec", "FaultStorage", "ReadBatch", "Storage", "StorageOptions", "check_index", "chunk_codec",
           "file_type", "in_memory_array", "inner_offset", "io_counters", "kvstore_spec", "misplaced", "open_storage",
           "plain_body", "release_buffers", "status_code", "storage_error", "tile_grid", "translate_error"]


def open_storage(location: Storage | str | os.PathLike, options: StorageOptions | None = None) -> Storage:
    """The :class:`Storage` for ``location``: a Storage is returned as it is (``options``
    are its own already); a path or URL (the table above) opens TensorStore's kvstore for
    it, with ``options`` (default :class:`~zarrckpt.StorageOptions`)."""
    if isinstance(location, Storage):
        return location
    return TensorStoreStorage(location, options)
