"""zarrckpt.format.tree: key escaping, flatten, the stored tree document, tree_keys, set_at."""

from __future__ import annotations

import collections
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zarrckpt.errors import FormatError, UnsupportedValueError
from zarrckpt.format.tree import (
    decode_tree,
    encode_tree,
    escape,
    flatten,
    key_of,
    set_at,
    tree_keys,
    unescape,
)

SETTINGS = settings(max_examples=300, deadline=None)
SEGMENT = re.compile(r"[A-Za-z0-9._%-]+")


# ------------------------------------------------------------------ 1. escape / unescape


@pytest.mark.parametrize(
    "raw,escaped",
    [
        ("a/b", "a%2Fb"),
        ("..", "%2E."),
        (".", "%2E"),
        (".hidden", "%2Ehidden"),
        ("", "%"),
        ("zarr.json", "zarr%2Ejson"),
        ("__x", "%5F_x"),
        ("__", "%5F_"),
        ("_x", "_x"),
        ("héllo", "h%C3%A9llo"),
        ("%", "%25"),
        ("%2E", "%252E"),
        ("a b", "a%20b"),
        ("a\\b", "a%5Cb"),
        ("layer.0.weight", "layer.0.weight"),
        ("exp_avg-sq", "exp_avg-sq"),
        ("zarr.json.bak", "zarr.json.bak"),
        ("😀", "%F0%9F%98%80"),
    ],
)
def test_escape_examples(raw, escaped):
    assert escape(raw) == escaped
    assert unescape(escaped) == raw


def test_escape_ints():
    assert escape(0) == "0"
    assert escape(17) == "17"
    assert escape(-3) == "-3"
    assert key_of(("optim", "state", 3, "exp_avg")) == "optim/state/3/exp_avg"
    assert key_of(("a/b", "..", "")) == "a%2Fb/%2E./%"
    assert key_of(()) == ""


def check_segment(seg: str) -> None:
    assert "/" not in seg and "\\" not in seg
    assert seg not in (".", "..")
    assert not seg.startswith(".")
    assert not seg.startswith("__")
    assert seg != "zarr.json"
    assert SEGMENT.fullmatch(seg), seg
    assert len(seg.encode()) <= 255


# At most 4 UTF-8 bytes -> 12 escaped bytes a character: 21 characters always fit in 255.
short_text = st.text(max_size=21)


@SETTINGS
@given(short_text)
def test_escape_round_trip_and_safe(s):
    seg = escape(s)
    check_segment(seg)
    assert unescape(seg) == s


@SETTINGS
@given(st.lists(short_text, min_size=2, max_size=8, unique=True))
def test_escape_injective(strings):
    segs = [escape(s) for s in strings]
    assert len(set(segs)) == len(segs)


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=0, max_size=120))
def test_escape_long_text_fits_or_raises(s):
    try:
        seg = escape(s)
    except UnsupportedValueError:
        # only when the escaped form cannot fit one path segment
        full = "".join(
            c if re.fullmatch(r"[A-Za-z0-9._-]", c) else "".join(f"%{b:02X}" for b in c.encode())
            for c in s
        )
        assert len(full.encode()) > 255
    else:
        check_segment(seg)
        assert unescape(seg) == s


@SETTINGS
@given(st.text(alphabet=st.sampled_from("._-_%/aZ9é"), max_size=12))
def test_escape_tricky_alphabet(s):
    seg = escape(s)
    check_segment(seg)
    assert unescape(seg) == s


def test_overlong_component_raises():
    assert escape("a" * 255) == "a" * 255
    with pytest.raises(UnsupportedValueError, match="255"):
        escape("a" * 256)
    with pytest.raises(UnsupportedValueError):
        escape("é" * 43)  # 43 * 6 = 258 escaped bytes
    assert len(escape("é" * 42)) == 252
    with pytest.raises(UnsupportedValueError):
        escape("." + "a" * 253)  # the leading %2E pushes it over
    with pytest.raises(UnsupportedValueError):
        encode_tree({"a" * 300: object()}, lambda x: False)
    with pytest.raises(UnsupportedValueError):
        list(flatten({"a": {"b" * 300: 1}}, lambda x: False))


@pytest.mark.parametrize("bad", [True, False, 1.5, float("nan"), None, (1, 2), b"x"])
def test_bad_key_types_raise(bad):
    with pytest.raises(UnsupportedValueError):
        escape(bad)
    with pytest.raises(UnsupportedValueError):
        encode_tree({bad: 1}, lambda x: False)
    with pytest.raises(UnsupportedValueError):
        list(flatten({bad: 1}, lambda x: False))
    with pytest.raises(TypeError):  # UnsupportedValueError is a TypeError
        escape(bad)


# ------------------------------------------------------------- 2. encode / decode tree


class Arr:
    """A stand-in for a tensor leaf."""

    def __init__(self, tag: int) -> None:
        self.tag = tag

    def __repr__(self) -> str:
        return f"Arr({self.tag})"


def is_arr(x) -> bool:
    return isinstance(x, Arr)


def same(a, b) -> bool:
    """Structural equality that tells list from tuple, bool from int from float, and NaN == NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(
            type(k) is type(k2) and same(a[k], b[k2]) for k, k2 in zip(a, b)
        )
    return a is b if isinstance(a, Arr) else a == b


keys = st.one_of(st.text(max_size=6), st.integers(-3, 20))
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0]),
    st.text(max_size=5),
    st.builds(Arr, st.integers(0, 1000)),
    st.binary(max_size=3),
)


def _unique_segments(d: dict) -> bool:
    return len({escape(k) for k in d}) == len(d)


def containers(children):
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4).filter(_unique_segments),
    )


trees = st.recursive(leaves, containers, max_leaves=25)
roots = st.one_of(st.dictionaries(keys, trees, max_size=5).filter(_unique_segments), trees)


def arrays_of(obj) -> dict:
    return {key_of(p): leaf for p, leaf in flatten(obj, is_arr) if is_arr(leaf) or isinstance(leaf, bytes)}


@SETTINGS
@given(roots)
def test_encode_decode_round_trip(obj):
    node = encode_tree(obj, is_arr)
    # the stored tree is strict JSON (no NaN/Infinity tokens) and survives a JSON round trip
    text = json.dumps(node, allow_nan=False)
    stored = json.loads(text)
    arrays = arrays_of(obj)
    asked = []

    def load_array(key):
        asked.append(key)
        return arrays[key]

    back = decode_tree(stored, load_array)
    assert same(back, obj), (obj, back, node)
    assert sorted(asked) == sorted(arrays)


def test_round_trip_example():
    a, b = Arr(1), Arr(2)
    obj = {
        "model": {"w": a, "b": b},
        "optim": {
            "state": {0: {"step": 3, "exp_avg": Arr(3)}, 1: {}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "extra": {"nan": float("nan"), "inf": float("inf"), "ninf": -float("inf"), "none": None},
        "flags": [True, False],
        "empty": {"d": {}, "l": [], "t": ()},
        "raw": b"\x00\x01",
        "": {"..": "dots", "a/b": 1},
    }
    node = encode_tree(obj, is_arr)
    d = dict(node["dict"])
    assert d["model"] == {"dict": [["w", {"array": "model/w"}], ["b", {"array": "model/b"}]]}
    assert d["flags"] == {"json": [True, False]}
    assert d["raw"] == {"array": "raw"}
    assert d[""] == {"json": {"..": "dots", "a/b": 1}}  # plain JSON collapses to one node
    optim = dict(d["optim"]["dict"])
    assert optim["state"]["dict"][0][0] == 0  # int keys stay ints
    assert optim["state"]["dict"][1] == [1, {"json": {}}]
    assert optim["param_groups"]["list"][0]["dict"][1] == ["betas", {"tuple": [{"json": 0.9}, {"json": 0.999}]}]
    extra = dict(d["extra"]["dict"])
    assert extra["nan"] == {"float": "nan"}
    assert extra["inf"] == {"float": "inf"}
    assert extra["ninf"] == {"float": "-inf"}
    assert extra["none"] == {"json": None}
    arrays = arrays_of(obj)
    assert set(arrays) == {"model/w", "model/b", "optim/state/0/exp_avg", "raw"}
    back = decode_tree(json.loads(json.dumps(node, allow_nan=False)), arrays.__getitem__)
    assert same(back, obj)


def test_plain_json_subtrees_collapse():
    ia = lambda x: False  # noqa: E731
    assert encode_tree({"a": {"b": [1, 2.5, "x", None, True, {"c": []}]}}, ia) == {
        "dict": [["a", {"json": {"b": [1, 2.5, "x", None, True, {"c": []}]}}]]
    }
    # the root dict is always a dict node, even when it is plain JSON
    assert encode_tree({"a": 1}, ia) == {"dict": [["a", {"json": 1}]]}
    assert encode_tree({}, ia) == {"dict": []}
    # not plain JSON: tuples, int keys, non-finite floats
    assert encode_tree({"a": {"b": (1,)}}, ia) == {"dict": [["a", {"dict": [["b", {"tuple": [{"json": 1}]}]]}]]}
    assert encode_tree({"a": {1: 1}}, ia) == {"dict": [["a", {"dict": [[1, {"json": 1}]]}]]}
    assert encode_tree({"a": [1.0, float("nan")]}, ia) == {
        "dict": [["a", {"list": [{"json": 1.0}, {"float": "nan"}]}]]
    }


@pytest.mark.parametrize(
    "obj",
    [
        {0: 1, "0": 2},
        {"0": 1, 0: 2},
        {"a": {"x": 1, 5: 2, "5": 3}},
        {-1: 1, "-1": 2},
    ],
)
def test_int_and_str_key_collision_raises(obj):
    with pytest.raises(UnsupportedValueError, match="same stored name"):
        encode_tree(obj, lambda x: False)


class Opaque:
    pass


@pytest.mark.parametrize(
    "obj,where,typename",
    [
        ({"opt": {"state": [1, {1, 2}]}}, "opt/state/1", "set"),
        ({"a": object()}, "'a'", "object"),
        ({"x/y": {3: (1, Opaque())}}, "x%2Fy/3/1", "Opaque"),
        ({"f": frozenset()}, "'f'", "frozenset"),
        ({"c": 1j}, "'c'", "complex"),
    ],
)
def test_unsupported_value_names_key_and_type(obj, where, typename):
    with pytest.raises(UnsupportedValueError) as ei:
        encode_tree(obj, lambda x: False)
    msg = str(ei.value)
    assert where in msg
    assert typename in msg
    assert isinstance(ei.value, TypeError)


def test_unsupported_custom_type_names_module():
    with pytest.raises(UnsupportedValueError, match=r"test_tree\.Opaque|Opaque"):
        encode_tree({"k": Opaque()}, lambda x: False)


@pytest.mark.parametrize(
    "node",
    [
        None,
        [],
        "json",
        1,
        {},
        {"json": 1, "array": "a"},
        {"bogus": 1},
        {"array": 5},
        {"array": None},
        {"float": "NaN"},
        {"float": "Infinity"},
        {"float": 1.0},
        {"float": None},
        {"list": {"a": 1}},
        {"list": "ab"},
        {"tuple": None},
        {"dict": {"a": {"json": 1}}},
        {"dict": [["a"]]},
        {"dict": [["a", {"json": 1}, "extra"]]},
        {"dict": [("a", {"json": 1})]},
        {"dict": [[1.5, {"json": 1}]]},
        {"dict": [[True, {"json": 1}]]},
        {"dict": [[None, {"json": 1}]]},
        {"dict": [["a", 1]]},
        {"list": [{"json": 1}, {"nope": 2}]},
        {"dict": [["a", {"tuple": [{"float": "nan"}, {}]}]]},
    ],
)
def test_decode_rejects_malformed(node):
    with pytest.raises(FormatError):
        decode_tree(node, lambda k: pytest.fail("no array expected"))


def test_decode_error_says_where():
    with pytest.raises(FormatError, match=r"tree/a\[1\]"):
        decode_tree({"dict": [["a", {"list": [{"json": 1}, {"bad": 0}]}]]}, lambda k: None)
    with pytest.raises(ValueError):  # FormatError is a ValueError
        decode_tree({"bad": 0}, lambda k: None)


# ---------------------------------------------------------------- 3. flatten / tree_keys


def leaf_paths_tree(obj):
    return [p for p, _ in tree_keys(encode_tree(obj, is_arr))]


def leaf_paths_flat(obj):
    return [p for p, _ in flatten(obj, is_arr)]


# State dicts are dicts (zarrckpt.save rejects any other root), empty ones included.
dict_roots = st.dictionaries(keys, trees, max_size=5).filter(_unique_segments)


@SETTINGS
@given(dict_roots)
def test_flatten_matches_tree_keys(obj):
    flat = leaf_paths_flat(obj)
    assert leaf_paths_tree(obj) == flat
    assert len({key_of(p) for p in flat}) == len(flat)  # distinct keys


def test_flatten_matches_tree_keys_examples():
    obj = {"a": {}, "b": [], "c": [[], {}], "d": {1: {}}, "e": {"x": {"y": []}}, "f": (Arr(0), b"")}
    expected = [("a",), ("b",), ("c", 0), ("c", 1), ("d", 1), ("e", "x", "y"), ("f", 0), ("f", 1)]
    assert leaf_paths_flat(obj) == expected
    assert leaf_paths_tree(obj) == expected
    leaves_by_path = dict(tree_keys(encode_tree(obj, is_arr)))
    assert leaves_by_path[("f", 0)] == {"array": "f/0"}
    assert leaves_by_path[("a",)] == {"json": {}}


def test_flatten_matches_tree_keys_empty_tuple():
    # regression: {'tuple': []} must be a leaf of tree_keys, as () is of flatten, or
    # zarrckpt.load(strict=True) of a state dict holding () raises MissingKeysError
    obj = {"w": Arr(0), "betas": (), "nested": [((),)], 3: ()}
    assert leaf_paths_flat(obj) == [("w",), ("betas",), ("nested", 0, 0), (3,)]
    assert leaf_paths_tree(obj) == leaf_paths_flat(obj)


def test_flatten_matches_tree_keys_empty_root():
    # regression: an empty state dict has no keys on either side (it used to flatten to
    # key '', so zarrckpt.load({}, path) of a saved {} raised MissingKeysError)
    assert leaf_paths_flat({}) == []
    assert leaf_paths_tree({}) == []


# ------------------------------------------------------------------------------ set_at


Pair = collections.namedtuple("Pair", "x y")


def test_set_at_rebuilds_tuples():
    inner = (3, 4)
    root = {"a": (1, [2, inner]), "p": Pair(1, (5, 6)), "l": [0, {"k": 1}]}
    a_list = root["a"][1]
    out = set_at(root, ("a", 1, 1, 0), 9)
    assert out is root
    assert root["a"] == (1, [2, (9, 4)])
    assert root["a"][1] is a_list  # lists are updated in place
    assert inner == (3, 4)
    set_at(root, ("p", 1, 0), 7)
    assert root["p"] == Pair(1, (7, 6)) and type(root["p"]) is Pair
    set_at(root, ("p", 0), "x")
    assert root["p"] == Pair("x", (7, 6)) and type(root["p"]) is Pair
    set_at(root, ("l", 1, "k"), 2)
    assert root["l"] == [0, {"k": 2}]
    # a tuple root is returned rebuilt
    t = (1, (2, 3))
    assert set_at(t, (1, 1), 0) == (1, (2, 0))
    assert t == (1, (2, 3))
    # the empty path replaces the root
    assert set_at({"a": 1}, (), 5) == 5


@SETTINGS
@given(dict_roots)
def test_set_at_every_leaf(obj):
    marker = Arr(-1)
    for path, _ in list(flatten(obj, is_arr)):
        new = set_at(obj, path, marker)
        got = dict(flatten(new, is_arr))
        assert got[path] is marker
        obj = new
    assert all(leaf is marker for _, leaf in flatten(obj, is_arr))
