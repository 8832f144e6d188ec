"""Every error zarrckpt raises on purpose.

Each class also subclasses the builtin a caller would naturally catch, so
``except FileNotFoundError`` keeps working::

    ZarrckptError
    ├── CheckpointNotFoundError      (FileNotFoundError)  no checkpoint at the path
    ├── IncompleteCheckpointError    (RuntimeError)       save interrupted or still running
    ├── CheckpointExistsError        (FileExistsError)    refusing to overwrite
    ├── FormatError                  (ValueError)         metadata that breaks the spec
    │   └── IntegrityError                                a digest of the root does not match
    ├── CorruptChunkError            (OSError)            a chunk is missing or fails its checksum
    ├── StorageError                 (OSError)            the store refused or failed an operation
    │                                                     (full disk, read-only, permission,
    │                                                     unreachable endpoint, missing bucket)
    ├── CheckpointChangedError       (RuntimeError)       replaced while it was being read, or
    │                                                     since a zarrckpt.open() handle was opened
    ├── StateDictMismatchError       (ValueError)         target and checkpoint disagree
    │   ├── MissingKeysError         (KeyError)
    │   ├── UnexpectedKeysError      (KeyError)
    │   ├── ShapeMismatchError
    │   └── DTypeMismatchError       (TypeError)
    ├── UnsupportedValueError        (TypeError)          a leaf that can't be stored (or a
    │                                                     load target that can't be read into)
    ├── UnsupportedPlacementError    (ValueError)         e.g. Partial()
    ├── SaveFailedError              (RuntimeError)       some rank failed during a save
    │   └── ConcurrentSaveError                           another save took the path over
    ├── LoadFailedError              (RuntimeError)       another rank's load failed
    ├── ManagerClosedError           (RuntimeError)       a CheckpointManager used after close()
    ├── MissingDependencyError       (ImportError)        an optional package (torch, jax...) is absent
    └── DistributedError             (RuntimeError)       a collective failed (a peer died)

When one rank fails, every rank of the group raises an error of the same class,
naming the ranks that failed (``SaveFailedError``/``LoadFailedError`` when the
failing rank's error is not a zarrckpt error).

Messages say what was expected, what was found, and where (the key).
"""

from __future__ import annotations

__all__ = [
    "CheckpointChangedError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ConcurrentSaveError",
    "CorruptChunkError",
    "DTypeMismatchError",
    "DistributedError",
    "FormatError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "LoadFailedError",
    "ManagerClosedError",
    "MissingDependencyError",
    "MissingKeysError",
    "SaveFailedError",
    "ShapeMismatchError",
    "StateDictMismatchError",
    "StorageError",
    "UnexpectedKeysError",
    "UnsupportedPlacementError",
    "UnsupportedValueError",
    "ZarrckptError",
    "by_name",
]


class ZarrckptError(Exception):
    """Base class of every error zarrckpt raises deliberately."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class CheckpointNotFoundError(ZarrckptError, FileNotFoundError):
    """There is no zarrckpt checkpoint at the path."""


class IncompleteCheckpointError(ZarrckptError, RuntimeError):
    """The checkpoint was never committed: its save was interrupted or is still running."""


class CheckpointExistsError(ZarrckptError, FileExistsError):
    """A save would replace an existing checkpoint (or foreign data) without ``overwrite=True``."""


class FormatError(ZarrckptError, ValueError):
    """Metadata on storage does not follow the zarrckpt spec (or is a newer major version)."""


class CorruptChunkError(ZarrckptError, OSError):
    """A chunk is missing, truncated or fails its crc32c checksum."""


class StorageError(ZarrckptError, OSError):
    """The store refused or failed an operation: a full disk, a read-only mount, a
    permission problem, an unreachable endpoint, a missing bucket, refused credentials."""


class CheckpointChangedError(ZarrckptError, RuntimeError):
    """The checkpoint at the path was replaced (overwritten) while it was being read, or
    after the ``zarrckpt.open()`` handle used to read it was opened (spec §7.3). Raised
    instead of the integrity or chunk error such a replacement causes mid-read (chained
    from it); nothing read may be trusted: load or open it again."""


class StateDictMismatchError(ZarrckptError, ValueError):
    """The target state dict and the checkpoint disagree."""


class MissingKeysError(StateDictMismatchError, KeyError):
    """Keys the target expects are not in the checkpoint."""


class UnexpectedKeysError(StateDictMismatchError, KeyError):
    """The checkpoint holds keys the target does not have (``strict=True``)."""


class ShapeMismatchError(StateDictMismatchError):
    """A saved tensor's global shape differs from the target's."""


class DTypeMismatchError(StateDictMismatchError, TypeError):
    """A saved tensor's dtype differs from the target's and casting was not asked for."""


class UnsupportedValueError(ZarrckptError, TypeError):
    """A state-dict leaf that zarrckpt cannot store without pickle, or a load target it
    cannot read into in place (sparse, nested, quantized tensors)."""


class UnsupportedPlacementError(ZarrckptError, ValueError):
    """A DTensor placement that has no stored form (``Partial``) or an unknown one."""


class SaveFailedError(ZarrckptError, RuntimeError):
    """At least one rank failed while writing; the checkpoint was not committed."""


class ConcurrentSaveError(SaveFailedError):
    """Another save to the same path committed first or took the path over; this one
    was not committed (the other save's checkpoint is intact)."""


class LoadFailedError(ZarrckptError, RuntimeError):
    """A load failed on another rank of the group (the message names it and its error)."""


class ManagerClosedError(ZarrckptError, RuntimeError):
    """A :class:`~zarrckpt.CheckpointManager` was asked to save after :meth:`close` (or
    after leaving its ``with`` block); make a new manager for the same root instead."""


class MissingDependencyError(ZarrckptError, ImportError):
    """A zarrckpt call needs an optional package that is not installed (or fails to import).

    Also an :class:`ImportError`. ``package`` names the missing module."""

    def __init__(self, message: str, package: str) -> None:
        super().__init__(message)
        self.package = package
        self.name = package


class DistributedError(ZarrckptError, RuntimeError):
    """A collective of zarrckpt failed: a peer process died or the group timed out."""


def by_name(name: str) -> type[ZarrckptError] | None:
    """The zarrckpt error class called ``name`` (to raise one rank's error class on all)."""
    cls = globals().get(name)
    return cls if isinstance(cls, type) and issubclass(cls, ZarrckptError) else None


class IntegrityError(FormatError):
    """A digest recorded in the root ``zarr.json`` does not match the bytes it covers (spec
    §6.6): the root itself, an array's ``zarr.json``, or the set of arrays was changed after
    the commit (a flipped bit, a truncated or edited file). The message names what."""
