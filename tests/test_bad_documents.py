"""One table of bad documents, refused by the JSON Schema twin and by the parsers alike.

Every case is one rule of spec/format.md. Each runs through the schema (``spec/zarrckpt.schema.json``)
and through the parsers a reader uses (``zarrckpt.format.documents.parse_root_bytes`` /
``decode_document`` + ``parse_array``), so the two cannot drift. A rule the schema cannot
express (JSON syntax, digests over bytes, cross-document rules) is marked with the reason,
and the parser is then checked alone. ``match`` makes sure the parser refuses for the
reason the case is about, not another one.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import pytest

from test_spec import assert_valid, is_valid
from zarrckpt import errors
from zarrckpt.format import documents as fmt

SAVE_ID = "c088eeef2a2e4ebbb33f64d834138a"  # 30 digits, as zarrckpt writes
HEX = "ab" * 32


@dataclass
class Bad:
    doc: Any  # attributes / document (dict, list ...) or the raw bytes of a document
    match: str  # regex the parser's message must match
    error: type = errors.FormatError
    schema: str | None = ""  # "" = the schema refuses it too; otherwise why it cannot


# ------------------------------------------------------------------ good documents


def good_packed() -> dict:
    return {"pack": ".packs/0", "offset": 48, "nbytes": 6, "kind": "tensor", "data_type": "bfloat16", "shape": [3]}


def good_root() -> dict:
    """Root attributes of format 1.0 (no digests)."""
    return {
        "format": "zarrckpt", "version": "1.0", "state": "committed", "save_id": SAVE_ID,
        "world_size": 2, "created": "2026-11-26T04:26:36.445412Z", "writer": {"zarrckpt": "0.1.0"},
        "committed": "2026-11-26T04:26:37.394615Z", "num_arrays": 2,
        "tree": {"dict": [["w", {"array": "w"}], [3, {"list": [{"json": 1}, {"float": "nan"}]}],
                          ["b", {"packed": good_packed()}]]},
    }


def root_document(attrs: Any) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": {"zarrckpt": attrs}}


def seal(attrs: dict) -> dict:
    """``attrs`` with ``digests.root`` set to the digest of its document's bytes (§6.6)."""
    attrs = copy.deepcopy(attrs)
    attrs["digests"]["root"] = fmt.ZERO_DIGEST
    attrs["digests"]["root"] = fmt.sha256_hex(fmt.encode_document(root_document(attrs)))
    return attrs


def good_root_11() -> dict:
    """Root attributes of format 1.1: digests of the two arrays and of itself."""
    return seal(dict(good_root(), version="1.1", digests={
        "algorithm": "sha256", "root": fmt.ZERO_DIGEST, "arrays": {".packs/0": "cd" * 32, "w": HEX}}))


def good_dtensor() -> dict:
    return {
        "kind": "dtensor", "save_id": SAVE_ID, "torch_dtype": "bfloat16",
        "mesh": {"shape": [2, 4], "dim_names": ["dp", "tp"], "device_type": "cuda"},
        "placements": [{"type": "strided_shard", "dim": 0, "split_factor": 4}, {"type": "shard", "dim": 0}],
    }


def array_document(attrs: Any = None, **members: Any) -> dict:
    """A valid array zarr.json (the dtensor of good_dtensor unless ``attrs``) with ``members``
    replaced; ``data_type`` follows the attributes' torch_dtype when that is a valid name."""
    attrs = good_dtensor() if attrs is None else attrs
    dt = attrs.get("torch_dtype") if isinstance(attrs, dict) else None
    if dt not in fmt.dtypes.ZARR_NAMES:
        dt = "bfloat16"
    one_d = isinstance(attrs, dict) and attrs.get("kind") in ("bytes", "bytesio", "pack")
    doc = {
        "zarr_format": 3, "node_type": "array", "shape": [12] if one_d else [16, 8], "data_type": dt,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [12] if one_d else [2, 8]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": {"bool": False, "complex64": [0.0, 0.0], "complex128": [0.0, 0.0]}.get(dt, 0),
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "attributes": {"zarrckpt": attrs},
        "dimension_names": ["w.0"] if one_d else ["w.0", "w.1"],
    }
    doc.update(members)
    return doc


def sharded_codecs(**config: Any) -> list:
    cfg = {"chunk_shape": [1, 4],
           "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                      {"name": "zstd", "configuration": {"level": 1, "checksum": False}}, {"name": "crc32c"}],
           "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
           "index_location": "end"}
    cfg.update(config)
    return [{"name": "sharding_indexed", "configuration": {k: v for k, v in cfg.items() if v is not None}}]


GOOD_ARRAYS = {
    "dtensor": array_document(),
    "tensor": array_document({"kind": "tensor", "save_id": SAVE_ID, "torch_dtype": "float32"}),
    "sharded codecs, zstd": array_document(codecs=sharded_codecs()),
    "sharded, no index_location": array_document(codecs=sharded_codecs(index_location=None)),
    "bytes": array_document({"kind": "bytes", "save_id": SAVE_ID, "torch_dtype": "uint8"}),
    "bytesio": array_document({"kind": "bytesio", "save_id": SAVE_ID, "torch_dtype": "uint8"}),
    "sharded_tensor": array_document({"kind": "sharded_tensor", "save_id": SAVE_ID, "torch_dtype": "float32",
                                      "mesh": {"shape": [4], "dim_names": None, "device_type": "cpu"},
                                      "placements": [{"type": "shard", "dim": 1}]}),
    "0-d sharded_tensor": array_document({"kind": "sharded_tensor", "save_id": SAVE_ID, "torch_dtype": "float32",
                                          "mesh": {"shape": [2], "dim_names": None, "device_type": "cpu"},
                                          "placements": [{"type": "replicate"}]},
                                         shape=[], chunk_grid={"name": "regular", "configuration": {"chunk_shape": []}},
                                         dimension_names=[]),
    "gzip, NaN fill": array_document({"kind": "tensor", "save_id": SAVE_ID, "torch_dtype": "float32"},
                                     fill_value="NaN", codecs=[
                                         {"name": "bytes", "configuration": {"endian": "little"}},
                                         {"name": "gzip", "configuration": {"level": 5}}, {"name": "crc32c"}]),
    "hex fill, extension member, no dimension_names": {
        **{k: v for k, v in array_document().items() if k != "dimension_names"},
        "fill_value": "0x7fc0", "my_extension": {"must_understand": False, "x": 1}},
    "complex": array_document({"kind": "ndarray", "save_id": SAVE_ID, "torch_dtype": "complex64"},
                              fill_value=["NaN", 0]),
    "empty dimension": array_document({"kind": "tensor", "save_id": SAVE_ID, "torch_dtype": "float32"},
                                      shape=[0, 7], chunk_grid={"name": "regular", "configuration": {"chunk_shape": [1, 7]}}),
    "pack": array_document({"kind": "pack", "save_id": SAVE_ID, "torch_dtype": "uint8"}),
}


def parse_root(doc_or_bytes: Any) -> fmt.RootInfo:
    data = doc_or_bytes if isinstance(doc_or_bytes, bytes) else fmt.encode_document(root_document(doc_or_bytes))
    return fmt.parse_root_bytes(data, "mem://ckpt")


def parse_array(doc_or_bytes: Any, pack: bool | None = None) -> fmt.ArrayInfo:
    if isinstance(doc_or_bytes, bytes):
        doc = fmt.decode_document(doc_or_bytes, "w/zarr.json")
    else:
        doc = doc_or_bytes
    return fmt.parse_array(doc, "w", SAVE_ID, pack=pack)


def test_good_documents_are_accepted():
    """The bad-document tests below would pass vacuously if these failed."""
    for attrs in (good_root(), good_root_11(), dict(good_root(), tree={"dict": []}, num_arrays=0)):
        assert_valid("rootAttributes", attrs)
        assert_valid(None, attrs)
        info = parse_root(attrs)
        assert info.arrays == {"w", ".packs/0"} or attrs["num_arrays"] == 0
    assert parse_root(good_root_11()).array_digests == {".packs/0": "cd" * 32, "w": HEX}
    pending = {k: v for k, v in good_root().items() if k not in ("committed", "num_arrays", "tree")}
    assert_valid("rootAttributes", dict(pending, state="pending"))
    with pytest.raises(errors.IncompleteCheckpointError):
        parse_root(dict(pending, state="pending"))
    future = dict(good_root_11(), version="1.7", future_member={"x": 1})
    future["digests"]["future"] = 1
    future["digests"]["chunks"] = {".packs/0": "", "w": ""}  # required from 1.3 (§6.6.1)
    assert_valid("rootAttributes", future)  # §10: later minor versions add members
    array = {"zarr_format": 3, "node_type": "array"}
    doc = dict(root_document(future), consolidated_metadata={  # required from 1.2 (§6.7)
        "kind": "inline", "must_understand": False,
        "metadata": {".packs": {"zarr_format": 3, "node_type": "group"}, ".packs/0": array, "w": array}})
    future["digests"]["root"] = fmt.ZERO_DIGEST
    future["digests"]["root"] = fmt.sha256_hex(fmt.encode_document(doc))
    assert set(fmt.parse_root_bytes(fmt.encode_document(doc), "mem://ckpt").consolidated) == {".packs", ".packs/0", "w"}
    with pytest.raises(errors.FormatError, match="consolidated_metadata"):
        parse_root(seal(future))  # the same root without it
    for save_id in ("0" * 16, "f" * 64, "1f1c246b27834679a6cdb39815b19fe8"):  # §6.1: 16 to 64 digits
        assert_valid("rootAttributes", dict(good_root(), save_id=save_id))
        parse_root(dict(good_root(), save_id=save_id))
    assert_valid("treeNode", {"array": "a/%/%2Eb/%5F_c/zarr%2Ejson.x/-1/%C3%BC"})
    for packed in (good_packed(), dict(good_packed(), pack=".packs/12", offset=0),
                   dict(good_packed(), shape=[], nbytes=2), dict(good_packed(), shape=[0, 7], nbytes=0),
                   {"pack": ".packs/1", "offset": 8, "nbytes": 3, "kind": "bytes", "data_type": "uint8", "shape": [3]},
                   {"pack": ".packs/1", "offset": 8, "nbytes": 3, "kind": "bytesio", "data_type": "uint8", "shape": [3]},
                   dict(good_packed(), kind="ndarray", data_type="complex128", shape=[2, 2], nbytes=64)):
        assert_valid("treeNode", {"packed": packed})
        fmt.parse_packed(packed, "k")
    for name, doc in GOOD_ARRAYS.items():
        assert_valid("arrayDocument", doc, name)
        assert_valid(None, doc["attributes"]["zarrckpt"], name)
        parse_array(doc, pack=doc["attributes"]["zarrckpt"]["kind"] == "pack")
    # §5.6: writers always write torch_dtype (the schema requires it); readers may do without
    parse_array(array_document({"kind": "tensor", "save_id": SAVE_ID}, data_type="float32"))


# ------------------------------------------------------------------ the table: root attributes


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def _root_with_tree(node: Any, arrays: int = 0) -> dict:
    return dict(good_root(), tree={"dict": [["k", node]]}, num_arrays=arrays)


def _packed_case(d: Any) -> dict:
    return _root_with_tree({"packed": d}, 1)


NOT_EXPRESSIBLE = "a cross-document rule (spec §6.2): not expressible in JSON Schema"

BAD_ROOTS: dict[str, Bad] = {
    "missing version": Bad(_without(good_root(), "version"), "version"),
    "version 2.0 (another major)": Bad(dict(good_root(), version="2.0"), "not readable"),
    "version without minor": Bad(dict(good_root(), version="1"), "major.minor"),
    "version with leading zero": Bad(dict(good_root(), version="1.01"), "major.minor"),
    "version as a number": Bad(dict(good_root(), version=1.1), "major.minor"),
    "other format": Bad(dict(good_root(), format="zarr"), "format"),
    "unknown state": Bad(dict(good_root(), state="done"), "unknown state"),
    "committed without tree": Bad(_without(good_root(), "tree"), "root must be a 'dict' node"),
    "committed without num_arrays": Bad(_without(good_root(), "num_arrays"), "num_arrays"),
    "num_arrays a boolean": Bad(dict(good_root(), num_arrays=True), "num_arrays"),
    "pending with tree": Bad(dict(good_root(), state="pending"), "incomplete", errors.IncompleteCheckpointError),
    "save_id not hex": Bad(dict(good_root(), save_id="not-an-id-not-an-id"), "save_id"),
    "save_id of 15 digits": Bad(dict(good_root(), save_id="0" * 15), "save_id"),
    "save_id of 65 digits": Bad(dict(good_root(), save_id="0" * 65), "save_id"),
    "save_id upper-case": Bad(dict(good_root(), save_id=SAVE_ID.upper()), "save_id"),
    "save_id not a string": Bad(dict(good_root(), save_id=12345678901234567890), "save_id"),
    "world_size 0": Bad(dict(good_root(), world_size=0), "world_size"),
    "world_size a boolean": Bad(dict(good_root(), world_size=True), "world_size"),
    "created not UTC": Bad(dict(good_root(), created="2026-11-26 04:26:36"), "created"),
    "created month 13": Bad(dict(good_root(), created="2026-13-26T04:26:36Z"), "created"),
    "committed not a time": Bad(dict(good_root(), committed=5), "committed"),
    "writer version not a string": Bad(dict(good_root(), writer={"zarrckpt": 1}), "writer"),
    "writer a list": Bad(dict(good_root(), writer=["zarrckpt"]), "writer"),
    "tree is a list node": Bad(dict(good_root(), tree={"list": []}), "root must be a 'dict' node"),
    "unknown node kind": Bad(_root_with_tree({"set": []}), "unknown node kind"),
    "node with two members": Bad(_root_with_tree({"json": 1, "array": "k"}), "exactly one member"),
    "empty node": Bad(_root_with_tree({}), "exactly one member"),
    "node is not an object": Bad(_root_with_tree([1]), "exactly one member"),
    "float NaN spelled like JSON": Bad(_root_with_tree({"float": "NaN"}), "'float' node"),
    "float node holding a number": Bad(_root_with_tree({"float": 1.5}), "'float' node"),
    "dict entry with a bool key": Bad(dict(good_root(), tree={"dict": [[True, {"json": 1}]]}, num_arrays=0),
                                      "string or an integer"),
    "dict entry with a float key": Bad(dict(good_root(), tree={"dict": [[1.5, {"json": 1}]]}, num_arrays=0),
                                       "string or an integer"),
    "dict entry without node": Bad(dict(good_root(), tree={"dict": [["a"]]}, num_arrays=0), r"\[key, node\] pair"),
    "dict entry with 3 elements": Bad(dict(good_root(), tree={"dict": [["a", {"json": 1}, 2]]}, num_arrays=0),
                                      r"\[key, node\] pair"),
    "dict entry as object": Bad(dict(good_root(), tree={"dict": {"a": {"json": 1}}}, num_arrays=0),
                                "root must be a 'dict' node"),
    "nested bad node": Bad(_root_with_tree({"list": [{"tuple": [{"array": 3}]}]}, 1), "own key's array"),
    "list node holding an object": Bad(_root_with_tree({"list": {"a": {"json": 1}}}), "must hold a list"),
    "array path escapes the directory": Bad(_root_with_tree({"array": "../etc/passwd"}, 1), "own key's array"),
    "array path with hidden segment": Bad(_root_with_tree({"array": "a/.hidden"}, 1), "own key's array"),
    "array path with empty segment": Bad(_root_with_tree({"array": "a//b"}, 1), "own key's array"),
    "array path is zarr.json": Bad(_root_with_tree({"array": "a/zarr.json"}, 1), "own key's array"),
    "array path with __ segment": Bad(_root_with_tree({"array": "__x"}, 1), "own key's array"),
    "array path with lower-case hex": Bad(_root_with_tree({"array": "a%2fb"}, 1), "own key's array"),
    "array path with a bad escape": Bad(_root_with_tree({"array": "a%zz"}, 1), "own key's array"),
    "array path with a space": Bad(_root_with_tree({"array": "a b"}, 1), "own key's array"),
    "empty array path": Bad(_root_with_tree({"array": ""}, 1), "own key's array"),
    "array node naming a pack": Bad(_root_with_tree({"array": ".packs/0"}, 1), "own key's array"),
    "array node naming another key's array": Bad(
        dict(good_root(), tree={"dict": [["a", {"array": "b"}], ["b", {"array": "b"}]]}, num_arrays=1),
        "own key's array", schema=NOT_EXPRESSIBLE),
    "num_arrays disagreeing with the tree": Bad(dict(good_root(), num_arrays=3), "num_arrays is 3",
                                                schema=NOT_EXPRESSIBLE),
    "duplicate dict key": Bad(dict(good_root(), tree={"dict": [["a", {"json": 1}], ["a", {"json": 2}]]},
                                   num_arrays=0), "duplicate key", schema=NOT_EXPRESSIBLE),
    "int and str keys colliding once escaped": Bad(
        dict(good_root(), tree={"dict": [[3, {"json": 1}], ["3", {"json": 2}]]}, num_arrays=0),
        "same stored name", schema=NOT_EXPRESSIBLE),
    "key longer than 255 bytes once escaped": Bad(
        dict(good_root(), tree={"dict": [["é" * 43, {"json": 1}]]}, num_arrays=0), "255",
        schema=NOT_EXPRESSIBLE),
    "key with a lone surrogate": Bad(dict(good_root(), tree={"dict": [["a\ud800", {"json": 1}]]}, num_arrays=0),
                                     "not valid Unicode", schema="JSON Schema strings may hold lone surrogates"),
    "string value with a lone surrogate": Bad(_root_with_tree({"json": ["\udfff"]}), "not valid Unicode",
                                              schema="JSON Schema strings may hold lone surrogates"),
    "tree 33 levels deep": Bad(dict(good_root(), num_arrays=0, tree=__import__("functools").reduce(
        lambda node, _: {"dict": [["x", node]]}, range(33), {"json": 1})), "levels deep",
        schema="depth is not expressible in JSON Schema"),
    "json value 40 levels deep": Bad(_root_with_tree({"json": __import__("functools").reduce(
        lambda v, _: [v], range(40), 1)}), "levels deep", schema="depth is not expressible in JSON Schema"),
    "packed node with array and packed": Bad(_root_with_tree({"packed": good_packed(), "array": "k"}, 1),
                                             "exactly one member"),
    "packed node as a list": Bad(_packed_case([".packs/0", 48, 6]), "must hold an object"),
    **{f"packed node {name}": Bad(_packed_case(d), match) for name, (d, match) in {
        "without pack": (_without(good_packed(), "pack"), "exactly the members"),
        "without offset": (_without(good_packed(), "offset"), "exactly the members"),
        "without nbytes": (_without(good_packed(), "nbytes"), "exactly the members"),
        "without kind": (_without(good_packed(), "kind"), "exactly the members"),
        "without data_type": (_without(good_packed(), "data_type"), "exactly the members"),
        "without shape": (_without(good_packed(), "shape"), "exactly the members"),
        "with an extra member": (dict(good_packed(), crc=0), "exactly the members"),
        "in a pack outside .packs": (dict(good_packed(), pack="packs/0"), "pack must be"),
        "in a pack with a leading zero": (dict(good_packed(), pack=".packs/01"), "pack must be"),
        "in a nested pack path": (dict(good_packed(), pack=".packs/0/1"), "pack must be"),
        "in a pack named by a key": (dict(good_packed(), pack="model/w"), "pack must be"),
        "in a pack outside the checkpoint": (dict(good_packed(), pack="../.packs/0"), "pack must be"),
        "with a negative offset": (dict(good_packed(), offset=-8), "offset"),
        "with an unaligned offset": (dict(good_packed(), offset=4), "offset"),
        "with offset as a string": (dict(good_packed(), offset="48"), "offset"),
        "with offset a boolean": (dict(good_packed(), offset=False), "offset"),
        "with a negative nbytes": (dict(good_packed(), nbytes=-1), "nbytes"),
        "of kind dtensor": (dict(good_packed(), kind="dtensor"), "unknown packed kind"),
        "of kind pack": (dict(good_packed(), kind="pack"), "unknown packed kind"),
        "with an unknown data type": (dict(good_packed(), data_type="float8_e4m3"), "not one zarrckpt reads"),
        "with a negative extent": (dict(good_packed(), shape=[-3]), "bad shape"),
        "with a boolean extent": (dict(good_packed(), shape=[True, 3], nbytes=6), "bad shape"),
        "of bytes that are not uint8": (dict(good_packed(), kind="bytes"), "1-d uint8"),
        "of bytesio that are not uint8": (dict(good_packed(), kind="bytesio"), "1-d uint8"),
        "of bytes with a 2-d shape": (dict(good_packed(), kind="bytes", data_type="uint8", shape=[2, 3]), "1-d uint8"),
    }.items()},
    "packed node with nbytes disagreeing with its shape": Bad(
        _packed_case(dict(good_packed(), nbytes=8)), "nbytes disagrees", schema=NOT_EXPRESSIBLE),
    "1.0 root with metadata (a relabelled later root)": Bad(dict(good_root(), metadata={"step": 1}),
                                                             "has no 'metadata'"),
    # format 1.1: digests (§6.6)
    "1.1 root without digests": Bad(_without(good_root_11(), "digests"), "must record 'digests'"),
    "digests of another algorithm": Bad(seal(dict(good_root_11(), digests=dict(good_root_11()["digests"],
                                                                                 algorithm="md5"))), "algorithm"),
    "root digest not hex": Bad(dict(good_root_11(), digests=dict(good_root_11()["digests"], root="XY" * 32)),
                               "64 lower-case hex"),
    "array digest not hex": Bad(seal(dict(good_root_11(), digests=dict(
        good_root_11()["digests"], arrays={".packs/0": "cd" * 32, "w": "00"}))), "64 lower-case hex"),
    "array digest for a path outside the checkpoint": Bad(seal(dict(good_root_11(), digests=dict(
        good_root_11()["digests"], arrays={".packs/0": "cd" * 32, "w": HEX, "../x": HEX}))),
        "does not list exactly", errors.IntegrityError),
    "root digest that does not match": Bad(dict(good_root_11(), digests=dict(good_root_11()["digests"],
                                                                              root="ef" * 32)),
                                           "does not match its own digest", errors.IntegrityError,
                                           schema="a digest over bytes (spec §6.6)"),
    "root digest after a change of the tree": Bad(dict(good_root_11(), world_size=3),
                                                  "does not match its own digest", errors.IntegrityError,
                                                  schema="a digest over bytes (spec §6.6)"),
    "array digests missing an array": Bad(seal(dict(good_root_11(), digests=dict(
        good_root_11()["digests"], arrays={"w": HEX}))), "without a digest", errors.IntegrityError,
        schema=NOT_EXPRESSIBLE),
}


@pytest.mark.parametrize("case", list(BAD_ROOTS.values()), ids=list(BAD_ROOTS))
def test_schema_refuses_bad_root(case):
    if case.schema:  # a rule the schema cannot express: it accepts, only the parser refuses
        assert is_valid("rootAttributes", case.doc), f"the schema now refuses it: drop the note {case.schema!r}"
        return
    assert not is_valid("rootAttributes", case.doc)
    assert not is_valid(None, case.doc)
    assert not is_valid("rootDocument", root_document(case.doc))


@pytest.mark.parametrize("case", list(BAD_ROOTS.values()), ids=list(BAD_ROOTS))
def test_parser_refuses_bad_root(case):
    with pytest.raises(case.error, match=case.match):
        parse_root(case.doc)


def test_schema_and_parser_tie_consolidated_metadata_to_version_and_state():
    """§6.7: a committed root of 1.2 or later carries consolidated_metadata; roots of 1.0 and 1.1
    need none; a pending root has none (readers refuse pending roots anyway, §7.1)."""
    array = {"zarr_format": 3, "node_type": "array"}  # the entries' own rules are the array document's
    consolidated = {"kind": "inline", "must_understand": False, "metadata": {}}
    for attrs in (good_root(), good_root_11()):
        assert_valid("rootDocument", root_document(attrs))
    root_12 = dict(good_root_11(), version="1.2", num_arrays=1, tree={"dict": [["w", {"array": "w"}]]},
                   digests=dict(good_root_11()["digests"], arrays={"w": HEX}))
    assert not is_valid("rootDocument", root_document(root_12))
    with pytest.raises(errors.FormatError, match="must carry consolidated_metadata"):
        parse_root(seal(root_12))
    doc = dict(root_document(root_12), consolidated_metadata=dict(consolidated, metadata={"w": array}))
    assert is_valid("rootDocument", dict(doc, consolidated_metadata=dict(
        consolidated, metadata={"w": GOOD_ARRAYS["tensor"]})))
    root_12["digests"]["root"] = fmt.ZERO_DIGEST
    root_12["digests"]["root"] = fmt.sha256_hex(fmt.encode_document(doc))
    assert set(fmt.parse_root_bytes(fmt.encode_document(doc), "mem://ckpt").consolidated) == {"w"}
    pending = {k: v for k, v in good_root().items() if k not in ("committed", "num_arrays", "tree")}
    pending = root_document(dict(pending, state="pending", version="1.2"))
    assert is_valid("rootDocument", pending)
    assert not is_valid("rootDocument", dict(pending, consolidated_metadata=consolidated))


# ------------------------------------------------------------------ the table: array documents


def _with_placement(p: Any) -> dict:
    return array_document(dict(good_dtensor(), placements=[p, {"type": "shard", "dim": 0}]))


def _attrs(**kw: Any) -> dict:
    return array_document(dict(good_dtensor(), **kw))


def _tensor(**members: Any) -> dict:
    return array_document({"kind": "tensor", "save_id": SAVE_ID, "torch_dtype": "float32"}, **members)


def _sharded_tensor(**kw: Any) -> dict:
    attrs = {"kind": "sharded_tensor", "save_id": SAVE_ID, "torch_dtype": "float32",
             "mesh": {"shape": [4], "dim_names": None, "device_type": "cpu"}, "placements": [{"type": "shard", "dim": 0}]}
    attrs.update(kw)
    return array_document(attrs)


_LITTLE = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}
SHAPE_RULE = "a rule between members (spec §5.1): not expressible in JSON Schema"
LONG_MESH = ("JSON Schema cannot compare two lengths: the schema ties them for meshes of up to 8 dimensions "
             "(one conditional per length), the parsers for all")

BAD_ARRAYS: dict[str, Bad] = {
    # attributes (§5.6, §5.7)
    "unknown placement type": Bad(_with_placement({"type": "partial"}), "bad placement"),
    "placement without type": Bad(_with_placement({"dim": 0}), "bad placement"),
    "shard without dim": Bad(_with_placement({"type": "shard"}), "exactly the members"),
    "shard with negative dim": Bad(_with_placement({"type": "shard", "dim": -1}), "not a dimension"),
    "shard with a boolean dim": Bad(_with_placement({"type": "shard", "dim": False}), "not a dimension"),
    "shard with extra member": Bad(_with_placement({"type": "shard", "dim": 0, "split_factor": 2}),
                                   "exactly the members"),
    "strided_shard without split_factor": Bad(_with_placement({"type": "strided_shard", "dim": 0}),
                                              "exactly the members"),
    "strided_shard with split_factor 0": Bad(
        _with_placement({"type": "strided_shard", "dim": 0, "split_factor": 0}), "split_factor"),
    "replicate with a dim": Bad(_with_placement({"type": "replicate", "dim": 0}), "exactly the members"),
    "placement as a string": Bad(_with_placement("Shard(0)"), "bad placement"),
    "placement dim beyond the array's dims": Bad(_with_placement({"type": "shard", "dim": 2}), "not a dimension"),
    "dtensor without mesh": Bad(array_document(_without(good_dtensor(), "mesh")), "needs a 'mesh'"),
    "dtensor without placements": Bad(array_document(_without(good_dtensor(), "placements")), "placements must"),
    "placements and mesh of different lengths": Bad(_attrs(placements=[{"type": "replicate"}]), "placements must"),
    "placements and a 9-d mesh of different lengths": Bad(_attrs(
        mesh={"shape": [1] * 9, "dim_names": None, "device_type": "cpu"}, placements=[{"type": "replicate"}] * 8),
        "placements must", schema=LONG_MESH),
    "mesh with empty shape": Bad(_attrs(mesh={"shape": [], "dim_names": None, "device_type": "cpu"}), "mesh shape"),
    "mesh with size 0": Bad(_attrs(mesh={"shape": [0], "dim_names": None, "device_type": "cpu"}), "mesh shape"),
    "mesh shape a string": Bad(_attrs(mesh={"shape": "2x4", "dim_names": None, "device_type": "cpu"}), "mesh shape"),
    "mesh dim_names not strings": Bad(_attrs(mesh={"shape": [2, 4], "dim_names": [1, 2], "device_type": "cpu"}),
                                      "dim_names"),
    "mesh dim_names shorter than the mesh": Bad(_attrs(mesh={"shape": [2, 4], "dim_names": ["dp"],
                                                             "device_type": "cpu"}), "dim_names"),
    "mesh dim_names longer than the mesh": Bad(_attrs(mesh={"shape": [2, 4], "dim_names": ["dp", "tp", "pp"],
                                                            "device_type": "cpu"}), "dim_names"),
    "mesh dim_names of another length, 9-d mesh": Bad(_attrs(
        mesh={"shape": [1] * 9, "dim_names": ["x"] * 8, "device_type": "cpu"}, placements=[{"type": "replicate"}] * 9),
        "dim_names", schema=LONG_MESH),
    "mesh as a list": Bad(_attrs(mesh=[2, 4]), "needs a 'mesh'"),
    "tensor with placements": Bad(array_document({"kind": "tensor", "save_id": SAVE_ID, "torch_dtype": "float32",
                                                  "placements": [{"type": "replicate"}]}), "no mesh or placements"),
    "unknown kind": Bad(_attrs(kind="pickle"), "unknown kind"),
    "missing save_id": Bad(array_document(_without(good_dtensor(), "save_id")), "save_id"),
    "save_id of 15 digits": Bad(array_document({"kind": "tensor", "save_id": "0" * 15, "torch_dtype": "float32"}),
                                "save_id"),
    "save_id of another save": Bad(array_document({"kind": "tensor", "save_id": "d" * 30, "torch_dtype": "float32"}),
                                   "mixes two saves", schema=NOT_EXPRESSIBLE),
    "zarr-extensions float8_e4m3 name": Bad(_attrs(torch_dtype="float8_e4m3"), "torch_dtype"),
    "torch-style dtype name": Bad(_attrs(torch_dtype="torch.float32"), "torch_dtype"),
    "torch_dtype disagreeing with data_type": Bad(array_document(dict(good_dtensor(), torch_dtype="float16"),
                                                                 data_type="bfloat16"), "torch_dtype"),
    "bytes that are not uint8": Bad(array_document({"kind": "bytes", "save_id": SAVE_ID, "torch_dtype": "float32"}),
                                    "1-d uint8"),
    "bytesio that are not uint8": Bad(array_document({"kind": "bytesio", "save_id": SAVE_ID,
                                                      "torch_dtype": "float32"}), "1-d uint8"),
    "pack that is not uint8": Bad(array_document({"kind": "pack", "save_id": SAVE_ID, "torch_dtype": "float32"}),
                                  "1-d uint8"),
    "pack with a mesh": Bad(array_document({"kind": "pack", "save_id": SAVE_ID, "torch_dtype": "uint8",
                                            "mesh": {"shape": [1], "dim_names": None, "device_type": "cpu"}}),
                            "no mesh or placements"),
    "pack of 2-d shape": Bad(dict(GOOD_ARRAYS["pack"], shape=[12, 1], chunk_grid={
        "name": "regular", "configuration": {"chunk_shape": [12, 1]}}, dimension_names=None), "1-d uint8"),
    "sharded_tensor with a 2-d mesh": Bad(_sharded_tensor(
        mesh={"shape": [2, 2], "dim_names": None, "device_type": "cpu"},
        placements=[{"type": "shard", "dim": 0}, {"type": "shard", "dim": 1}]), "sharded_tensor has a 1-d mesh"),
    "sharded_tensor with a strided shard": Bad(_sharded_tensor(
        placements=[{"type": "strided_shard", "dim": 0, "split_factor": 2}]), "sharded_tensor has a 1-d mesh"),
    # review item B9: [replicate] is the placement of a 0-d sharded_tensor only
    "sharded_tensor replicated on a 2-d array": Bad(_sharded_tensor(placements=[{"type": "replicate"}]),
                                                    r"placements \[shard d\] \(\[replicate\] when 0-d\)"),
    "sharded_tensor replicated on a 1-d array": Bad(_sharded_tensor(placements=[{"type": "replicate"}]) | {
        "shape": [12], "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [12]}},
        "dimension_names": ["w.0"]}, r"placements \[shard d\]"),
    "0-d sharded_tensor with a shard placement": Bad(GOOD_ARRAYS["0-d sharded_tensor"] | {"attributes": {"zarrckpt": dict(
        GOOD_ARRAYS["0-d sharded_tensor"]["attributes"]["zarrckpt"], placements=[{"type": "shard", "dim": 0}])}},
        "not a dimension"),
    "attributes not an object": Bad(array_document(attributes=["zarrckpt"]), "attributes must be an object"),
    "zarrckpt attributes not an object": Bad(array_document(attributes={"zarrckpt": "tensor"}), "attributes object"),
    "zarrckpt attributes missing": Bad(array_document(attributes={}), "attributes object"),
    # the document (§5.1, §5.5)
    "zarr.json is a list": Bad([array_document()], "must be an object"),
    "zarr v2": Bad(array_document(zarr_format=2), "not a Zarr v3 array"),
    "zarr_format as a string": Bad(array_document(zarr_format="3"), "not a Zarr v3 array"),
    "a group": Bad(array_document(node_type="group"), "not a Zarr v3 array"),
    "missing shape": Bad(_without(array_document(), "shape"), "'shape' is missing"),
    "shape with booleans": Bad(array_document(shape=[True, 8]), "shape"),
    "shape with a negative extent": Bad(array_document(shape=[-16, 8]), "shape"),
    "shape with a float extent": Bad(array_document(shape=[16.0, 8]), "shape",
                                     schema="JSON Schema counts 16.0 as an integer; Zarr v3 does not"),
    "shape beyond 2**63 - 1": Bad(array_document(shape=[2**64, 8]), "shape"),
    "shape of 33 dimensions": Bad(_tensor(shape=[1] * 33, chunk_grid={
        "name": "regular", "configuration": {"chunk_shape": [1] * 33}}, dimension_names=None), "at most 32"),
    "shape whose size overflows": Bad(array_document(shape=[2**62, 2**62]), "too large", schema=SHAPE_RULE),
    "unknown data type": Bad(array_document(data_type="float8_e4m3"), "not one zarrckpt reads"),
    "data type as an object": Bad(array_document(data_type={"name": "bfloat16"}), "data_type must be a name"),
    "irregular grid": Bad(array_document(chunk_grid={"name": "rectilinear", "configuration": {}}), "chunk_grid"),
    "chunk grid without configuration": Bad(array_document(chunk_grid={"name": "regular"}), "chunk_grid"),
    "chunk_shape with a zero": Bad(array_document(chunk_grid={"name": "regular",
                                                              "configuration": {"chunk_shape": [0, 8]}}), "chunk_shape"),
    "chunk_shape of another rank": Bad(array_document(chunk_grid={"name": "regular",
                                                                  "configuration": {"chunk_shape": [2]}}),
                                       "chunk_shape"),
    "chunk larger than the array": Bad(array_document(chunk_grid={
        "name": "regular", "configuration": {"chunk_shape": [2**40, 8]}}), "larger than the shape", schema=SHAPE_RULE),
    "dot separator": Bad(array_document(chunk_key_encoding={"name": "default", "configuration": {"separator": "."}}),
                         "chunk_key_encoding"),
    "v2 key encoding": Bad(array_document(chunk_key_encoding={"name": "v2", "configuration": {"separator": "/"}}),
                           "chunk_key_encoding"),
    "non-numeric fill value": Bad(array_document(fill_value="zero"), "fill_value"),
    "fill value null": Bad(array_document(fill_value=None), "fill_value"),
    "boolean fill value of a float": Bad(array_document(fill_value=True), "fill_value"),
    "float fill value of an int": Bad(_tensor(data_type="int32", fill_value=0.5,
                                              attributes={"zarrckpt": {"kind": "tensor", "save_id": SAVE_ID}}),
                                      "fill_value"),
    "int fill value out of range": Bad(_tensor(data_type="int8", fill_value=300, attributes={
        "zarrckpt": {"kind": "tensor", "save_id": SAVE_ID}}), "fill_value"),
    "int fill value out of range, with torch_dtype": Bad(_tensor(data_type="uint16", fill_value=65536, attributes={
        "zarrckpt": {"kind": "tensor", "save_id": SAVE_ID, "torch_dtype": "uint16"}}), "fill_value"),
    "float fill value of an int, with torch_dtype": Bad(_tensor(data_type="int32", fill_value=0.5, attributes={
        "zarrckpt": {"kind": "tensor", "save_id": SAVE_ID, "torch_dtype": "int32"}}), "fill_value"),
    "hex fill value of the wrong width": Bad(array_document(fill_value="0x7f"), "fill_value"),
    "hex fill value of a float32 NaN for float64": Bad(_tensor(data_type="float64", fill_value="0x7fc00000", attributes={
        "zarrckpt": {"kind": "tensor", "save_id": SAVE_ID, "torch_dtype": "float64"}}), "fill_value"),
    "complex fill value of one number": Bad(GOOD_ARRAYS["complex"] | {"fill_value": 0}, "fill_value"),
    "big endian": Bad(array_document(codecs=[{"name": "bytes", "configuration": {"endian": "big"}}, _CRC]),
                      "endian"),
    "bytes codec without configuration": Bad(array_document(codecs=[{"name": "bytes"}, _CRC]), "endian"),
    "no checksum": Bad(array_document(codecs=[_LITTLE]), "codecs must be"),
    "checksum before compression": Bad(array_document(codecs=[
        _LITTLE, _CRC, {"name": "zstd", "configuration": {"level": 1, "checksum": False}}]), "crc32c"),
    "transpose codec": Bad(array_document(codecs=[{"name": "transpose", "configuration": {"order": [1, 0]}},
                                                  _LITTLE, _CRC]), "first codec"),
    "blosc compression": Bad(array_document(codecs=[_LITTLE, {"name": "blosc", "configuration": {}}, _CRC]),
                             "compression codec"),
    "zstd without checksum member": Bad(array_document(codecs=[_LITTLE, {"name": "zstd", "configuration": {
        "level": 1}}, _CRC]), "compression codec"),
    "gzip level 10": Bad(array_document(codecs=[_LITTLE, {"name": "gzip", "configuration": {"level": 10}}, _CRC]),
                         "compression codec"),
    "crc32c with a configuration": Bad(array_document(codecs=[_LITTLE, {"name": "crc32c",
                                                                        "configuration": {"x": 1}}]), "crc32c"),
    "codec with an extra member": Bad(array_document(codecs=[dict(_LITTLE, x=1), _CRC]), "endian"),
    "sharding with the index at the start": Bad(array_document(codecs=sharded_codecs(index_location="start")),
                                                "index"),
    "sharding index without checksum": Bad(array_document(codecs=sharded_codecs(index_codecs=[_LITTLE])),
                                           "index_codecs"),
    "sharding without crc32c inside": Bad(array_document(codecs=sharded_codecs(codecs=[_LITTLE])), "codecs must be"),
    "sharding with an unknown member": Bad(array_document(codecs=sharded_codecs(extra=1)), "sharding_indexed needs"),
    "sharding twice": Bad(array_document(codecs=sharded_codecs() * 2), "first codec"),
    "inner chunk not dividing the chunk": Bad(array_document(codecs=sharded_codecs(chunk_shape=[1, 3])),
                                              "must divide", schema=SHAPE_RULE),
    "inner chunk of another rank": Bad(array_document(codecs=sharded_codecs(chunk_shape=[1])), "must divide"),
    "0-d array with the sharding codec": Bad(GOOD_ARRAYS["0-d sharded_tensor"] | {"codecs": sharded_codecs(chunk_shape=[])},
                                            "inner chunk_shape"),
    "storage transformers": Bad(array_document(storage_transformers=[{"name": "x"}]), "storage transformers"),
    "unknown member": Bad(array_document(consolidated=True), "unknown member"),
    "extension that must be understood": Bad(array_document(ext={"must_understand": True}), "unknown member"),
    "dimension_names of another length": Bad(array_document(dimension_names=["a"]), "dimension_names"),
    "dimension_names not strings": Bad(array_document(dimension_names=[1, 2]), "dimension_names"),
}


@pytest.mark.parametrize("case", list(BAD_ARRAYS.values()), ids=list(BAD_ARRAYS))
def test_schema_refuses_bad_array(case):
    if case.schema:  # a rule the schema cannot express: it accepts, only the parser refuses
        assert is_valid("arrayDocument", case.doc), f"the schema now refuses it: drop the note {case.schema!r}"
        return
    assert not is_valid("arrayDocument", case.doc)


@pytest.mark.parametrize("case", list(BAD_ARRAYS.values()), ids=list(BAD_ARRAYS))
def test_parser_refuses_bad_array(case):
    with pytest.raises(case.error, match=case.match):
        parse_array(case.doc)


COMPLEX_HEX_OF_THE_WRONG_WIDTH = GOOD_ARRAYS["complex"] | {"fill_value": ["0x7fc0", 0]}  # complex64: 8 digits


def test_schema_refuses_a_complex_fill_value_with_a_hex_part_of_the_wrong_width():
    """§5.2: each part of a complex fill value is a fill value of the component type (float32 for
    complex64), so a hexadecimal part has 8 digits."""
    assert not is_valid("arrayDocument", COMPLEX_HEX_OF_THE_WRONG_WIDTH)
    assert is_valid("arrayDocument", GOOD_ARRAYS["complex"] | {"fill_value": ["0x7fc00000", "0x00000000"]})


def test_parser_refuses_a_complex_fill_value_with_a_hex_part_of_the_wrong_width():
    with pytest.raises(errors.FormatError, match="fill_value"):
        parse_array(COMPLEX_HEX_OF_THE_WRONG_WIDTH)
    good = GOOD_ARRAYS["complex"] | {"fill_value": ["0x7fc00000", "0x00000000"]}
    assert parse_array(good).metadata["fill_value"] == ["0x7fc00000", "0x00000000"]


def test_parser_refuses_pack_kinds_in_the_wrong_place():
    """§6.5: pack arrays are exactly the arrays at .packs/<n>; an array node's array is never one."""
    with pytest.raises(errors.FormatError, match="kind 'pack' at a key's array path"):
        parse_array(GOOD_ARRAYS["pack"], pack=False)
    with pytest.raises(errors.FormatError, match="pack array must have kind 'pack'"):
        parse_array(GOOD_ARRAYS["tensor"], pack=True)


def test_parser_reduces_metadata_to_the_spec_members():
    """Extensions that may be ignored are not passed on to the Zarr implementation."""
    info = parse_array(GOOD_ARRAYS["hex fill, extension member, no dimension_names"])
    assert "my_extension" not in info.metadata and info.metadata["fill_value"] == "0x7fc0"
    assert parse_array(GOOD_ARRAYS["sharded codecs, zstd"]).inner_chunk_shape == (1, 4)


# ------------------------------------------------------------------ the table: raw bytes (JSON syntax, §3.2)


def _nested(depth: int) -> bytes:
    return b'{"zarr_format":3,"node_type":"group","attributes":{"zarrckpt":' + b"[" * depth + b"]" * depth + b"}}"


_ROOT_BYTES = fmt.encode_document(root_document(good_root()))
_ARRAY_BYTES = fmt.encode_document(array_document())
JSON_RULE = "JSON syntax (spec §3.2): a parsed document cannot show it"

BAD_BYTES: dict[str, tuple[str, Bad]] = {
    "duplicate member name": ("root", Bad(_ROOT_BYTES.replace(b'"world_size":2', b'"world_size":2,"world_size":3'),
                                          "appears twice", schema=JSON_RULE)),
    "duplicate member in an array document": ("array", Bad(_ARRAY_BYTES.replace(
        b'"data_type":"bfloat16"', b'"data_type":"bfloat16","data_type":"float32"'), "appears twice",
        schema=JSON_RULE)),
    "NaN token": ("root", Bad(_ROOT_BYTES.replace(b'{"json":1}', b'{"json":NaN}'), "NaN", schema=JSON_RULE)),
    "Infinity token": ("array", Bad(_ARRAY_BYTES.replace(b'"fill_value":0', b'"fill_value":Infinity'),
                                    "Infinity", schema=JSON_RULE)),
    "-Infinity token": ("root", Bad(_ROOT_BYTES.replace(b'{"json":1}', b'{"json":-Infinity}'), "Infinity",
                                    schema=JSON_RULE)),
    "number beyond a double": ("root", Bad(_ROOT_BYTES.replace(b'{"json":1}', b'{"json":1e400}'),
                                           "range of a double", schema=JSON_RULE)),
    "integer of 5000 digits": ("root", Bad(_ROOT_BYTES.replace(b'{"json":1}', b'{"json":' + b"9" * 5000 + b"}"),
                                           "5000 digits", schema=JSON_RULE)),
    "integer of 1001 digits": ("root", Bad(_ROOT_BYTES.replace(b'{"json":1}', b'{"json":-' + b"9" * 1001 + b"}"),
                                           "1001 digits", schema=JSON_RULE)),
    "shape extent of 5000 digits": ("array", Bad(_ARRAY_BYTES.replace(b'"shape":[16,8]',
                                                                      b'"shape":[' + b"1" * 5000 + b',8]'),
                                                 "5000 digits", schema=JSON_RULE)),
    "nesting 100000 deep": ("root", Bad(_nested(100000), "nested too deeply", schema=JSON_RULE)),
    "array document nesting 100000 deep": ("array", Bad(b'{"shape":' + b"[" * 100000 + b"]" * 100000 + b"}",
                                                         "nested too deeply", schema=JSON_RULE)),
    "not UTF-8": ("root", Bad(_ROOT_BYTES.replace(b'"0.1.0"', b'"0.1.0\xff"'), "not UTF-8", schema=JSON_RULE)),
    "UTF-16": ("root", Bad(_ROOT_BYTES.decode().encode("utf-16"), "not UTF-8", schema=JSON_RULE)),
    "byte order mark": ("root", Bad(b"\xef\xbb\xbf" + _ROOT_BYTES, "not valid JSON", schema=JSON_RULE)),
    "truncated": ("root", Bad(_ROOT_BYTES[:-7], "not valid JSON", schema=JSON_RULE)),
    "empty file": ("array", Bad(b"", "not valid JSON", schema=JSON_RULE)),
    "a JSON list": ("array", Bad(b"[1, 2]", "must hold a JSON object", schema=JSON_RULE)),
    "a JSON string": ("root", Bad(b'"zarr"', "must hold a JSON object", schema=JSON_RULE)),
    "trailing garbage": ("root", Bad(_ROOT_BYTES + b"x", "not valid JSON", schema=JSON_RULE)),
}


@pytest.mark.parametrize("target,case", list(BAD_BYTES.values()), ids=list(BAD_BYTES))
def test_parser_refuses_bad_bytes(target, case):
    with pytest.raises(case.error, match=case.match):
        (parse_root if target == "root" else parse_array)(case.doc)


def test_every_case_is_a_zarrckpt_error_with_a_message():
    """Never a builtin exception: every case above raised a ZarrckptError subclass (checked by
    pytest.raises), and each subclass also is the builtin callers catch."""
    for case in [*BAD_ROOTS.values(), *BAD_ARRAYS.values(), *(c for _, c in BAD_BYTES.values())]:
        assert issubclass(case.error, errors.ZarrckptError)
    assert issubclass(errors.IntegrityError, errors.FormatError) and issubclass(errors.FormatError, ValueError)


def test_json_examples_are_strict_json():
    """The documents above are what encode_document writes: strict JSON a reader parses."""
    for doc in (root_document(good_root()), root_document(good_root_11()), *GOOD_ARRAYS.values()):
        data = fmt.encode_document(doc)
        assert fmt.decode_document(data, "x") == json.loads(data)
