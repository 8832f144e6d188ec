"""Storage: the only package that imports TensorStore.

Everything zarrckpt puts on or reads from storage goes through :class:`Storage`:
small documents by key (``zarr.json`` files, the commit write) and array
regions (chunk writes, region reads). URLs name kvstores (spec §3):

==========================  ===============================================
``/abs/path``, ``rel/path``  local file system (TensorStore ``file`` driver)
``file:///abs/path``         the same
``memory://name``            in-process memory (tests)
``s3://bucket/prefix``       S3; ``AWS_ENDPOINT_URL``/``AWS_REGION`` honoured
``gs://bucket/prefix``       Google Cloud Storage
==========================  ===============================================

Errors of the store become :class:`~zarrckpt.errors.StorageError` (full disk,
read-only, permission, unreachable endpoint) or
:class:`~zarrckpt.errors.CorruptChunkError` (missing or damaged chunk), decided by
TensorStore's status code (:func:`translate_error`).
"""

from ._tensorstore import (
    Array,
    Storage,
    StorageOptions,
    in_memory_array,
    io_counters,
    kvstore_spec,
    storage_error,
    translate_error,
)

__all__ = ["Array", "Storage", "StorageOptions", "in_memory_array", "io_counters", "kvstore_spec", "storage_error",
           "translate_error"]
