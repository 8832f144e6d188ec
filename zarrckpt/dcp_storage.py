"""``zarrckpt.dcp_storage``: DCP storage reader/writer for zarrckpt checkpoints. See :mod:`zarrckpt.interop.dcp_storage`."""
from .interop.dcp_storage import ZarrckptStorageReader, ZarrckptStorageWriter
__all__ = ["ZarrckptStorageReader", "ZarrckptStorageWriter"]
