"""Every error zarrckpt raises on purpose.

Each class also subclasses the builtin a caller would naturally catch, so
``except FileNotFoundError`` keeps working::

    ZarrckptError
    ├── CheckpointNotFoundError      (FileNotFoundError)  no checkpoint at the path
    ├── IncompleteCheckpointError    (RuntimeError)       save interrupted or still running
    ├── CheckpointExistsError        (FileExistsError)    refusing to overwrite
    ├── FormatError                  (ValueError)         metadata that breaks the spec
    ├── CorruptChunkError            (OSError)            a chunk is missing or fails its checksum
    ├── StateDictMismatchError       (ValueError)         target and checkpoint disagree
    │   ├── MissingKeysError         (KeyError)
    │   ├── UnexpectedKeysError      (KeyError)
    │   ├── ShapeMismatchError
    │   └── DTypeMismatchError       (TypeError)
    ├── UnsupportedValueError        (TypeError)          a leaf that can't be stored
    ├── UnsupportedPlacementError    (ValueError)         e.g. Partial()
    └── SaveFailedError              (RuntimeError)       some rank failed during a save

Messages say what was expected, what was found, and where (the key).
"""

from __future__ import annotations

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptChunkError",
    "DTypeMismatchError",
    "FormatError",
    "IncompleteCheckpointError",
    "MissingKeysError",
    "SaveFailedError",
    "ShapeMismatchError",
    "StateDictMismatchError",
    "UnexpectedKeysError",
    "UnsupportedPlacementError",
    "UnsupportedValueError",
    "ZarrckptError",
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
    """A state-dict leaf that zarrckpt cannot store without pickle."""


class UnsupportedPlacementError(ZarrckptError, ValueError):
    """A DTensor placement that has no stored form (``Partial``) or an unknown one."""


class SaveFailedError(ZarrckptError, RuntimeError):
    """At least one rank failed while writing; the checkpoint was not committed."""
