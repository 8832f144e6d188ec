"""``zarrckpt.torchtitan``: zarrckpt as torchtitan's checkpointer backend (needs torchtitan).
See :mod:`zarrckpt.interop.torchtitan` for how a job config selects it."""

from .interop.torchtitan import ZarrckptCheckpointManager, use_zarrckpt

__all__ = ["ZarrckptCheckpointManager", "use_zarrckpt"]
