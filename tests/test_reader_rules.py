"""The reader rules settled in spec 1.3 after the review of 1.2's reader rules (issue 29 item 5;
spec/reader-rules-1.2-settled.md maps each problem to its section and to the test here or
elsewhere). Hand-made bad bytes, resealed (root digest, digests.arrays and digests.chunks
recomputed) where the edit is a hostile writer's, not damage."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _v11 import as_format_1_1, reseal_root

import zarrckpt
from zarrckpt import errors
from zarrckpt.format import documents as fmt


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "ckpt"
    zarrckpt.save({"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                             "b": torch.tensor([0.5, -1.0])},
                   "mask": torch.tensor([True, False, True, False]),
                   "step": 7}, path)
    return path


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_all(path: Path) -> dict:
    ckpt = zarrckpt.open(path)
    return {key: ckpt.read(key) for key in ckpt.keys()}


# ------------------------------------------------ A1: lone surrogates in every string (§3.2)

@pytest.mark.parametrize("where", ["writer", "unknown root member", "member name", "dimension_names"])
def test_a_lone_surrogate_escape_anywhere_in_a_document_is_refused(saved, tmp_path, where):
    """Spec §3.2: every string of every document (member names too) is Unicode scalar
    values; a \\uDC00 escape outside a pair is refused wherever it is, not only in the tree
    and metadata. Before 1.3 zarrckpt read it in `writer` (the review's A1)."""
    path = copy_of(saved, tmp_path / "c")

    def change(doc):
        attrs = doc["attributes"]["zarrckpt"]
        if where == "writer":
            attrs["writer"]["zarrckpt"] = "0.1\udc00"
        elif where == "unknown root member":
            doc["x-note"] = {"text": "a\ud800b"}
        elif where == "member name":
            attrs["writer"]["tool\udc00"] = "1"
        else:  # the consolidated entry of an array (1.2+: the metadata zarrckpt reads)
            entry = doc["consolidated_metadata"]["metadata"]["model/w"]
            entry["dimension_names"] = ["w.0", "\udc00"]
    reseal_root(path, change)
    assert b"\\udc00" in (path / "zarr.json").read_bytes() or b"\\ud800" in (path / "zarr.json").read_bytes()
    with pytest.raises(errors.FormatError, match="lone surrogate"):
        zarrckpt.open(path)


def test_a_lone_surrogate_in_an_array_document_of_1_1_is_refused_when_read(saved, tmp_path):
    """The same in an array zarr.json that a 1.1 reader reads (its digest recomputed)."""
    path = as_format_1_1(copy_of(saved, tmp_path / "c"))
    doc = json.loads((path / "model" / "w" / "zarr.json").read_bytes())
    doc["dimension_names"] = ["w.0", "\udc00"]
    data = fmt.encode_document(doc)
    (path / "model" / "w" / "zarr.json").write_bytes(data)
    reseal_root(path, lambda d: d["attributes"]["zarrckpt"]["digests"]["arrays"].__setitem__(
        "model/w", fmt.sha256_hex(data)))
    with pytest.raises(errors.FormatError, match="lone surrogate"):
        zarrckpt.open(path).read("model/w")
    assert zarrckpt.open(path).read("model/b").tolist() == [0.5, -1.0]  # §3.4: other arrays read


def test_paired_surrogate_escapes_and_escaped_backslashes_are_read():
    """The MUST-read counterparts: a pair is one scalar value, and '\\\\ud800' is a backslash
    followed by text."""
    assert fmt.decode_document(b'{"a": "\\ud83d\\ude00", "b": "\\\\udc00"}', "x") == {"a": "\U0001f600",
                                                                                     "b": "\\udc00"}


# ------------------------------------------------ A5: nesting (§3.2)

def _nested(depth_below: int) -> object:
    value: object = 1
    for _ in range(depth_below):
        value = [value]
    return value


@pytest.mark.parametrize("levels,ok", [(102, True), (103, False), (150, False)])
def test_documents_nested_deeper_than_102_levels_are_refused(saved, tmp_path, levels, ok):
    """Spec §3.2: depth counts objects and arrays, the document being 1; at most 102, unknown
    members included. An unknown root member nested 150 deep was read before 1.3 (A5)."""
    path = copy_of(saved, tmp_path / "c")
    # the document (1) and "x-deep" itself as the outermost list: levels - 1 lists
    reseal_root(path, lambda doc: doc.__setitem__("x-deep", _nested(levels - 1)))
    if ok:
        assert read_all(path)["step"] == 7
    else:
        with pytest.raises(errors.FormatError, match=f"nested too deeply: {levels} levels"):
            zarrckpt.open(path)


def test_nesting_is_counted_outside_strings():
    assert fmt.decode_document(b'{"a": "' + b"[" * 500 + b'"}', "x")["a"] == "[" * 500
    with pytest.raises(errors.FormatError, match="nested too deeply: 103 levels"):
        fmt.decode_document(b"[" * 103 + b"]" * 103, "x")
    with pytest.raises(errors.FormatError, match="nested too deeply"):
        fmt.decode_document(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "x")


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='{}[]"\\ab\n\u00e9'),
    lambda c: st.lists(c) | st.dictionaries(st.text(alphabet='{}[]"\\a'), c), max_leaves=30)


def _depth(v) -> int:
    return 1 + max([_depth(x) for x in (v.values() if isinstance(v, dict) else v)], default=0) \
        if isinstance(v, (dict, list)) else 0


@settings(max_examples=500, deadline=None)
@given(_JSON, st.booleans())
def test_nesting_is_the_parsed_depth(value, ascii_only):
    """The byte-level count (brackets, quotes, escapes) is the depth of the parsed value,
    whatever strings hold brackets, quotes and backslashes."""
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert fmt._nesting(raw) == _depth(value)


# ------------------------------------------------ A2: consolidated metadata closed (§6.7)

def test_an_extra_member_of_consolidated_metadata_is_refused(saved, tmp_path):
    """Spec §6.7: exactly kind, must_understand and metadata (the schema already said so;
    zarrckpt read an extra member before 1.3)."""
    path = copy_of(saved, tmp_path / "c")
    reseal_root(path, lambda doc: doc["consolidated_metadata"].__setitem__("extra", 1))
    with pytest.raises(errors.FormatError, match="consolidated_metadata must be exactly"):
        zarrckpt.open(path)


def test_a_group_entry_with_zarrckpt_attributes_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path / "c")
    reseal_root(path, lambda doc: doc["consolidated_metadata"]["metadata"]["model"].__setitem__(
        "attributes", {"zarrckpt": {"format": "zarrckpt"}}))
    with pytest.raises(errors.FormatError, match="entry 'model': a group document has no 'zarrckpt'"):
        zarrckpt.open(path)


def test_other_members_of_a_group_entry_are_ignored(saved, tmp_path):
    """What zarr-python writes for a group (attributes, a nested consolidated_metadata) reads."""
    path = copy_of(saved, tmp_path / "c")
    reseal_root(path, lambda doc: doc["consolidated_metadata"]["metadata"]["model"].update(
        {"attributes": {"note": "x"}, "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                                                "metadata": {}}}))
    assert read_all(path)["model/w"].shape == (3, 4)


# ------------------------------------------------ A3: what a refusal refuses (§3.4)

def test_a_refused_array_refuses_only_the_reads_that_need_it(saved, tmp_path):
    """Spec §3.4 (no behaviour change: zarrckpt parses array metadata when a read needs it):
    an invalid consolidated entry of one array fails that array's reads; the keys, other
    arrays and partial loads of other keys read; a whole load fails."""
    path = copy_of(saved, tmp_path / "c")
    reseal_root(path, lambda doc: doc["consolidated_metadata"]["metadata"]["model/w"].__setitem__(
        "data_type", "float128"))
    ckpt = zarrckpt.open(path)
    assert "model/w" in ckpt.keys()
    with pytest.raises(errors.FormatError, match="model/w"):
        ckpt.read("model/w")
    assert ckpt.read("model/b").tolist() == [0.5, -1.0]
    assert zarrckpt.load_state_dict(path, ["model/b"])["model"]["b"].tolist() == [0.5, -1.0]
    with pytest.raises(errors.FormatError, match="model/w"):
        zarrckpt.load_state_dict(path)


def test_a_refused_root_refuses_every_read(saved, tmp_path):
    """Root-level (§3.4): consolidated metadata that does not list exactly the arrays."""
    path = copy_of(saved, tmp_path / "c")
    reseal_root(path, lambda doc: doc["consolidated_metadata"]["metadata"].pop("model/b"))
    with pytest.raises(errors.FormatError, match="does not list exactly"):
        zarrckpt.open(path)


# ------------------------------------------------ B4: bool bytes other than 0 and 1 (§5.2)

def _bool_chunk_with(path: Path, byte: int) -> None:
    """Store the byte ``byte`` as element 1 of 'mask', with its CRC-32C and its 1.3 table
    entry recomputed (a writer that wrote it, not damage)."""
    chunk = path / "mask" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[1] = byte
    crc = crc32c.crc32c(bytes(data[:-4]))
    data[-4:] = crc.to_bytes(4, "little")
    chunk.write_bytes(bytes(data))

    def change(doc):
        digests = doc["attributes"]["zarrckpt"]["digests"]
        if "chunks" in digests:
            digests["chunks"]["mask"] = base64.b64encode(np.array([crc], "<u4").tobytes()).decode()
    reseal_root(path, change)


@pytest.mark.parametrize("chunk_io", ["direct", "tensorstore"])
@pytest.mark.parametrize("byte", [2, 0xFF])
def test_a_bool_byte_other_than_0_or_1_is_refused(saved, tmp_path, chunk_io, byte):
    """Spec §5.2: refused even when its CRC-32C and position hold, never mapped to true.
    TensorStore refused it already; zarrckpt's direct file reader returned the raw byte."""
    path = copy_of(saved, tmp_path / "c")
    _bool_chunk_with(path, byte)
    storage = zarrckpt.StorageOptions(chunk_io=chunk_io)
    with pytest.raises(errors.CorruptChunkError, match="mask"):
        zarrckpt.load_state_dict(path, ["mask"], storage=storage)
    with pytest.raises(errors.CorruptChunkError, match="mask"):
        zarrckpt.load({"mask": torch.zeros(4, dtype=torch.bool)}, path, strict=False, storage=storage)
    assert zarrckpt.load_state_dict(path, ["model/w"], storage=storage)["model"]["w"].shape == (3, 4)


def test_bool_bytes_0_and_1_read(saved, tmp_path):
    path = copy_of(saved, tmp_path / "c")
    _bool_chunk_with(path, 1)
    assert zarrckpt.load_state_dict(path, ["mask"])["mask"].tolist() == [True, True, True, False]
    assert zarrckpt.open(path).read("mask").tolist() == [True, True, True, False]


# ------------------------------------------------ B1, B2, B3, B7: no behaviour change, pinned

@pytest.mark.parametrize("value,ok", [
    ("2026-11-26T04:58:20Z", True), ("2026-11-26T04:58:20.123456789Z", True), ("2024-02-29T00:00:00Z", True),
    ("2026-11-26T23:59:60Z", False), ("2026-11-26T04:58:20.1234567891Z", False), ("2026-11-26t04:58:20Z", False),
    ("2026-11-26T04:58:20z", False), ("2026-11-26T04:58:20+00:00", False), ("2025-02-29T00:00:00Z", False),
    ("0000-01-01T00:00:00Z", False), ("2026-11-26T24:00:00Z", False)])
def test_time_strings_are_the_exact_profile(saved, tmp_path, value, ok):
    """Spec §6.1 (B1): the schema's pattern, a day that exists, no leap second."""
    path = copy_of(saved, tmp_path / "c")
    reseal_root(path, lambda doc: doc["attributes"]["zarrckpt"].__setitem__("committed", value))
    if ok:
        zarrckpt.open(path)
    else:
        with pytest.raises(errors.FormatError, match="committed must be a UTC time"):
            zarrckpt.open(path)


def _deep(k: int) -> dict:
    value: object = 1
    for _ in range(k):
        value = {"a": value}
    return value  # type: ignore[return-value]


@pytest.mark.parametrize("value,ok", [(_deep(31), True), (_deep(32), False), ({"ü" * 42: 1}, True),
                                      ({"ü" * 43: 1}, False), ({"n": -int("9" * 1000)}, True),
                                      ({"n": -int("9" * 1000) * 10}, False)])
def test_metadata_depth_names_and_integers(saved, tmp_path, value, ok):
    """Spec §6.1 (B2, B3) and §3.2 (B7): at most 31 member names below metadata; names measured
    as escaped segments (each 'ü' is %C3%BC, 6 bytes: 42 fit, 43 = 258 bytes do not, though their
    UTF-8 is 86 bytes); integers of 1000 digits, the sign not counted."""
    path = copy_of(saved, tmp_path / "c")
    reseal_root(path, lambda doc: doc["attributes"]["zarrckpt"].__setitem__("metadata", value))
    if ok:
        zarrckpt.open(path)
    else:
        with pytest.raises(errors.FormatError):
            zarrckpt.open(path)
