"""Rewrite a freshly saved checkpoint as format 1.1 (no consolidated metadata, spec §6.7),
resealed: what zarrckpt wrote before 1.2, whose readers read and digest-check every array
``zarr.json`` (§6.6) that 1.2 readers take from the root."""

from __future__ import annotations

import json
from pathlib import Path

from zarrckpt.format import documents as fmt


def as_format_1_1(path: str | Path) -> Path:
    path = Path(path)
    doc = json.loads((path / "zarr.json").read_bytes())
    del doc["consolidated_metadata"]
    attrs = doc["attributes"]["zarrckpt"]
    attrs["version"] = "1.1"
    attrs["digests"]["root"] = fmt.ZERO_DIGEST
    attrs["digests"]["root"] = fmt.sha256_hex(fmt.encode_document(doc))
    (path / "zarr.json").write_bytes(fmt.encode_document(doc))
    return path
