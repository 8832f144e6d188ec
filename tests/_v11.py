"""Rewrite a freshly saved checkpoint as format 1.1 (no consolidated metadata, spec §6.7),
resealed: what zarrckpt wrote before 1.2, whose readers read and digest-check every array
``zarr.json`` (§6.6) that 1.2 readers take from the root."""

from __future__ import annotations

import json
from pathlib import Path

from zarrckpt.format import documents as fmt


def reseal_root(path: str | Path, change) -> Path:
    """Apply ``change(root document)`` and write it back with a correct root digest (§6.6):
    a consistent edit, as a hostile or older writer would make."""
    path = Path(path)
    doc = json.loads((path / "zarr.json").read_bytes())
    change(doc)
    attrs = doc["attributes"]["zarrckpt"]
    attrs["digests"]["root"] = fmt.ZERO_DIGEST
    attrs["digests"]["root"] = fmt.sha256_hex(fmt.encode_document(doc))
    (path / "zarr.json").write_bytes(fmt.encode_document(doc))
    return path


def as_format_1_1(path: str | Path) -> Path:
    def change(doc: dict) -> None:
        del doc["consolidated_metadata"]
        doc["attributes"]["zarrckpt"]["version"] = "1.1"

    return reseal_root(path, change)
