"""Nested state dicts <-> flat ``{key path: leaf}`` and the stored ``tree`` document.

A *key path* is the tuple of dict keys / list indices that leads to a leaf,
e.g. ``("optim", "state", "layer.weight", "exp_avg")``. Its *key* (the string
users see and the array's path inside the checkpoint) escapes each component
and joins them with ``/`` (spec §4, "Keys and array paths"):

* bytes outside ``[A-Za-z0-9._-]`` are written ``%XX`` (UTF-8, upper-case hex),
  so ``/``, ``\\`` and ``%`` never reach storage unescaped;
* a leading ``.`` becomes ``%2E`` (no ``.``/``..``/hidden names),
* a leading ``__`` becomes ``%5F_`` (Zarr reserves ``__`` prefixes),
* the component ``zarr.json`` becomes ``zarr%2Ejson`` (it would shadow metadata),
* the empty string becomes ``%`` (the only ``%`` not followed by two hex digits).

Escaping is injective on strings, so distinct keys never share an array, and no key
can name anything outside the checkpoint directory. An integer and its decimal string
share a segment, so one dict must not hold both (writers and readers refuse it).

Limits (spec §6.2), checked while planning a save, before anything is written, and again
by readers: a key path has at most :data:`MAX_DEPTH` components; strings are Unicode
(no lone surrogates); integers have at most :data:`MAX_INT_DIGITS` decimal digits.

This module is pure Python: leaves are classified by a caller-supplied
function so that torch stays out of it.
"""

from __future__ import annotations

import math
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import FormatError, UnsupportedValueError

__all__ = [
    "KeyPath",
    "Leaf",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "decode_tree",
    "encode_tree",
    "escape",
    "flatten",
    "key_of",
    "parse_tree",
    "set_at",
    "tree_keys",
    "unescape",
]

KeyPath = tuple  # tuple[str | int, ...]
Leaf = tuple  # (key path, key, leaf node) as parse_tree returns them

MAX_DEPTH = 32  # components of a key path (spec §6.2): the root zarr.json then nests < 128 deep
MAX_INT_DIGITS = 1000  # decimal digits of an integer value or key (spec §6.2)

_SAFE = re.compile(r"[A-Za-z0-9._-]")
_PLAIN_SEGMENT = re.compile(r"(?!\.)(?!__)[A-Za-z0-9._-]{1,255}")  # a string that escapes to itself
_SURROGATE = re.compile("[\ud800-\udfff]")
_MAX_COMPONENT_BYTES = 255  # common file-system limit on one path component
_NODE_KINDS = ("dict", "list", "tuple", "array", "packed", "json", "float")


def _short(x: Any, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def _int_too_long(n: int) -> bool:
    """More than MAX_INT_DIGITS decimal digits? (without converting a huge int to decimal,
    which Python refuses beyond 4300 digits)"""
    if -(1 << 62) < n < (1 << 62):
        return False
    n = abs(int(n))
    bits = n.bit_length()
    if bits <= 3321:  # 2**3321 < 10**1000
        return False
    return bits > 3322 or n >= 10**MAX_INT_DIGITS


def escape(component: str | int) -> str:
    """Escape one key-path component into one storage path segment."""
    if isinstance(component, bool) or not isinstance(component, (str, int)):
        raise UnsupportedValueError(
            f"dict key {_short(component)} of type {type(component).__name__}: keys must be str or int"
        )
    if isinstance(component, int):
        if _int_too_long(component):
            raise UnsupportedValueError("an integer key is too long for a path segment")
        s = str(int(component))  # int subclasses (IntEnum) by their value
        if len(s) > _MAX_COMPONENT_BYTES:
            raise UnsupportedValueError(f"integer key of {len(s)} digits is too long for a path segment")
        return s
    return _escape_str(component)


@functools.lru_cache(maxsize=1 << 16)
def _escape_str(component: str) -> str:
    """escape() of a string (cached: a state's keys repeat across its leaves and saves)."""
    if _PLAIN_SEGMENT.fullmatch(component) and component != "zarr.json":
        return component  # the common case: nothing to escape
    if _SURROGATE.search(component):
        raise UnsupportedValueError(
            f"dict key {_short(component)} is not valid Unicode (it holds a lone surrogate, "
            "e.g. from a file name decoded with 'surrogateescape'); keys must have a UTF-8 form"
        )
    if component == "":
        return "%"
    if component == "zarr.json":
        return "zarr%2Ejson"
    out = []
    for ch in component:
        if _SAFE.fullmatch(ch):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    s = "".join(out)
    if s.startswith("."):
        s = "%2E" + s[1:]
    elif s.startswith("__"):
        s = "%5F" + s[1:]
    if len(s) > _MAX_COMPONENT_BYTES:
        raise UnsupportedValueError(
            f"key component {component[:40]!r}... escapes to {len(s)} bytes; "
            f"at most {_MAX_COMPONENT_BYTES} fit in one path segment"
        )
    return s


def unescape(segment: str) -> str:
    """Inverse of :func:`escape` for string components."""
    if segment == "%":
        return ""
    raw = bytearray()
    i = 0
    while i < len(segment):
        ch = segment[i]
        if ch == "%":
            hx = segment[i + 1 : i + 3]
            if len(hx) != 2 or not all(c in "0123456789ABCDEF" for c in hx):
                raise FormatError(f"bad escape {segment[i:i + 3]!r} in stored name {segment!r}")
            raw += bytes.fromhex(hx)
            i += 3
        else:
            raw += ch.encode()
            i += 1
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"stored name {segment!r} is not UTF-8 once unescaped") from None


def key_of(path: KeyPath) -> str:
    """The user-facing key (= array path) of a key path."""
    return "/".join(escape(c) for c in path)


def _where(prefix: KeyPath) -> str:
    """A key path for messages; never raises (the path may hold the bad component)."""
    try:
        return repr(key_of(prefix)) if prefix else "<root>"
    except UnsupportedValueError:
        return repr(prefix)[:200]


def _too_deep(prefix: KeyPath) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"the state dict is nested more than {MAX_DEPTH} levels deep at {_where(prefix[:MAX_DEPTH])} "
        f"(spec §6.2 limit; a container that holds itself also ends here)"
    )


# --------------------------------------------------------------------------- flatten


def flatten(
    obj: Any, is_array: Callable[[Any], bool], prefix: KeyPath = ()
) -> Iterator[tuple[KeyPath, Any]]:
    """Yield ``(key path, leaf)`` for every leaf of a nested dict/list/tuple.

    Leaves are arrays (``is_array``), ``bytes`` and JSON scalars. Containers
    are dicts with str/int keys, lists and tuples; an empty container is a
    leaf of its own (so both sides of a load agree on it).
    """
    if len(prefix) > MAX_DEPTH:
        raise _too_deep(prefix)
    if isinstance(obj, dict) and (obj or not prefix):
        for k, v in obj.items():
            try:
                escape(k)  # validates the key type early
            except UnsupportedValueError as e:
                raise UnsupportedValueError(f"under {_where(prefix)}: {e}") from None
            yield from flatten(v, is_array, prefix + (k,))
    elif isinstance(obj, (list, tuple)) and obj:
        for i, v in enumerate(obj):
            yield from flatten(v, is_array, prefix + (i,))
    else:
        yield prefix, obj


# ------------------------------------------------------------------------- tree JSON
#
# node := {"dict": [[key, node], ...]}     key: JSON string or integer
#       | {"list": [node, ...]} | {"tuple": [node, ...]}
#       | {"array": "<array path>"}        an array leaf stored as an array of its own
#       | {"packed": {"pack", "offset", "nbytes", "kind", "data_type", "shape"}}
#                                          a small one stored inside a pack array
#       | {"json": <JSON value>}           a subtree of plain JSON (finite floats only)
#       | {"float": "nan" | "inf" | "-inf"}


def _plain(obj: Any, prefix: KeyPath) -> tuple[bool, Any]:
    """(True, obj as plain JSON) when ``obj`` is plain JSON, else (False, None).

    Subclasses of int, float and str (IntEnum, numpy.float64, str enums) are stored as the
    base type's value; dict subclasses as dicts. Readers return the base types.
    """
    if obj is None or isinstance(obj, bool):
        return True, obj
    if isinstance(obj, int):
        if _int_too_long(obj):
            raise UnsupportedValueError(
                f"the integer at key {_where(prefix)} has more than {MAX_INT_DIGITS} decimal "
                "digits (spec §6.2 limit); store it as a string or bytes")
        return True, int(obj)
    if isinstance(obj, float):
        return (True, float(obj)) if math.isfinite(obj) else (False, None)
    if isinstance(obj, str):
        if _SURROGATE.search(obj):
            raise UnsupportedValueError(
                f"the string at key {_where(prefix)} is not valid Unicode (it holds a lone "
                "surrogate); store it as bytes, or encode it with errors='surrogateescape' first")
        return True, str(obj)
    if len(prefix) >= MAX_DEPTH and isinstance(obj, (list, dict)) and obj:
        raise _too_deep(prefix + ("?",))
    if isinstance(obj, list):
        out = []
        for i, v in enumerate(obj):
            ok, pv = _plain(v, prefix + (i,))
            if not ok:
                return False, None
            out.append(pv)
        return True, out
    if isinstance(obj, dict):
        outd = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                return False, None
            try:
                escape(k)  # Unicode and length of the key
            except UnsupportedValueError as e:
                raise UnsupportedValueError(f"under {_where(prefix)}: {e}") from None
            ok, pv = _plain(v, prefix + (k,))
            if not ok:
                return False, None
            outd[str(k)] = pv
        return True, outd
    return False, None


def _describe(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def encode_tree(
    obj: Any, is_array: Callable[[Any], bool], prefix: KeyPath = ()
) -> dict[str, Any]:
    """The stored ``tree`` node of ``obj``; array leaves become ``{"array": key}``.

    Raises :class:`UnsupportedValueError` naming the key for anything the format cannot
    hold: other leaf types, keys that collide once escaped, non-Unicode strings, integers
    over :data:`MAX_INT_DIGITS` digits, nesting deeper than :data:`MAX_DEPTH`.
    """
    if len(prefix) > MAX_DEPTH:
        raise _too_deep(prefix)
    if is_array(obj) or isinstance(obj, (bytes, bytearray, memoryview)):
        return {"array": key_of(prefix)}
    if not (isinstance(obj, dict) and not prefix):
        ok, plain = _plain(obj, prefix)
        if ok:
            return {"json": plain}
    if isinstance(obj, float):
        return {"float": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, dict):
        seen: dict[str, Any] = {}
        items = []
        for k, v in obj.items():
            try:
                seg = escape(k)
            except UnsupportedValueError as e:
                raise UnsupportedValueError(f"under {_where(prefix)}: {e}") from None
            if seg in seen:
                raise UnsupportedValueError(
                    f"keys {seen[seg]!r} and {k!r} under {_where(prefix)} "
                    f"map to the same stored name {seg!r}"
                )
            seen[seg] = k
            key = str(k) if isinstance(k, str) else int(k)  # subclasses by their value
            items.append([key, encode_tree(v, is_array, prefix + (k,))])
        return {"dict": items}
    if isinstance(obj, (list, tuple)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return {kind: [encode_tree(v, is_array, prefix + (i,)) for i, v in enumerate(obj)]}
    raise UnsupportedValueError(
        f"cannot store the value at key {_where(prefix)}: type {_describe(obj)} is not a "
        "tensor, bytes, or JSON-able value (int, float, bool, str, None, list/tuple/dict of "
        "them). zarrckpt never pickles: convert it yourself (e.g. to bytes or a dict), or give "
        "it state_dict()/load_state_dict() methods."
    )


# ------------------------------------------------------------------ reading the tree


def _bad(where: str, what: str) -> FormatError:
    return FormatError(f"tree at {where}: {what}")


def _check_str(s: str, where: str, what: str) -> None:
    if _SURROGATE.search(s):
        raise _bad(where, f"{what} {_short(s)} is not valid Unicode (lone surrogate)")


def _check_scalar(v: Any, where: str) -> None:
    if isinstance(v, str):
        _check_str(v, where, "string")
    elif isinstance(v, float):
        if not math.isfinite(v):
            raise _bad(where, "a 'json' node holds a non-finite number (use a 'float' node)")
    elif isinstance(v, int) and not isinstance(v, bool):
        if _int_too_long(v):
            raise _bad(where, f"an integer has more than {MAX_INT_DIGITS} digits")
    elif v is not None and not isinstance(v, bool):
        raise _bad(where, f"a 'json' node holds {type(v).__name__}, not JSON")


def parse_tree(tree: Any) -> list[Leaf]:
    """Validate a stored tree (spec §6.2-6.3) and return its leaves in stored order, as
    ``(key path, key, leaf node)``. Everything a reader relies on is checked here, with
    messages that name the key: node shapes, dict entries, duplicate keys and keys that
    collide once escaped, array paths (each must be its own key's path), depth, strings,
    integers. ``packed`` node contents are checked by :func:`zarrckpt.format.documents.parse_packed`."""
    if not (isinstance(tree, dict) and len(tree) == 1 and isinstance(tree.get("dict"), list)):
        raise FormatError("tree: the root must be a 'dict' node")
    out: list[Leaf] = []
    _walk(tree, (), "", out)
    return out


def _walk(node: Any, path: KeyPath, key: str, out: list[Leaf]) -> None:
    where = repr(key) if path else "<root>"
    if len(path) > MAX_DEPTH:
        raise _bad(where, f"nested more than {MAX_DEPTH} levels deep")
    if not isinstance(node, dict) or len(node) != 1:
        raise _bad(where, f"a node must be an object with exactly one member, found {_short(node)}")
    ((kind, body),) = node.items()
    if kind not in _NODE_KINDS:
        raise _bad(where, f"unknown node kind {_short(kind)}")
    if kind in ("dict", "list", "tuple"):
        if not isinstance(body, list):
            raise _bad(where, f"a {kind!r} node must hold a list")
        if not body and path:
            out.append((path, key, node))  # an empty container is a leaf
            return
        if kind == "dict":
            seen: dict[str, Any] = {}
            for entry in body:
                if not (isinstance(entry, list) and len(entry) == 2):
                    raise _bad(where, f"a dict entry must be a [key, node] pair, found {_short(entry)}")
                k = entry[0]
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise _bad(where, f"a dict key must be a string or an integer, found {_short(k)}")
                if isinstance(k, str):
                    _check_str(k, where, "key")
                try:
                    seg = escape(k)
                except UnsupportedValueError as e:
                    raise _bad(where, str(e)) from None
                if seg in seen:
                    same = seen[seg] == k and type(seen[seg]) is type(k)
                    raise _bad(where, f"duplicate key {k!r}" if same else
                               f"keys {seen[seg]!r} and {k!r} map to the same stored name {seg!r}")
                seen[seg] = k
                _walk(entry[1], path + (k,), f"{key}/{seg}" if path else seg, out)
        else:
            for i, sub in enumerate(body):
                _walk(sub, path + (i,), f"{key}/{i}" if path else str(i), out)
        return
    if kind == "array":
        if body != key:
            raise _bad(where, f"an 'array' node must name its own key's array {key!r}, found "
                       f"{_short(body)} (another key's array, a pack, or a path outside the checkpoint)")
    elif kind == "packed":
        if not isinstance(body, dict):
            raise _bad(where, "a 'packed' node must hold an object")
    elif kind == "float":
        if body not in ("nan", "inf", "-inf"):
            raise _bad(where, f"a 'float' node must be \"nan\", \"inf\" or \"-inf\", found {_short(body)}")
    elif kind == "json":
        _walk_json(body, path, key, out)
        return
    out.append((path, key, node))


def _walk_json(value: Any, path: KeyPath, key: str, out: list[Leaf]) -> None:
    where = repr(key)
    if isinstance(value, (dict, list)) and value:
        if len(path) >= MAX_DEPTH:
            raise _bad(where, f"nested more than {MAX_DEPTH} levels deep")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str):
                _check_str(k, where, "key")
            try:
                seg = escape(k)
            except UnsupportedValueError as e:
                raise _bad(where, str(e)) from None
            _walk_json(v, path + (k,), f"{key}/{seg}", out)
        return
    if not isinstance(value, (dict, list)):
        _check_scalar(value, where)
    out.append((path, key, {"json": value}))


def tree_keys(node: Any) -> Iterator[tuple[KeyPath, dict[str, Any]]]:
    """``(key path, leaf node)`` of a stored tree, descending into plain JSON too
    (validates it: see :func:`parse_tree`)."""
    for path, _, leaf in parse_tree(node):
        yield path, leaf


def decode_tree(node: Any, load_array: Callable[[Any], Any], where: str = "tree", _depth: int = 0) -> Any:
    """Rebuild the nested object; ``load_array(body)`` supplies array leaves (the value of an
    ``array`` node, a key, or of a ``packed`` node, its descriptor)."""
    if _depth > MAX_DEPTH + 1:
        raise FormatError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if not isinstance(node, dict) or len(node) != 1:
        raise FormatError(f"{where}: expected an object with exactly one member, found {_short(node)}")
    ((kind, body),) = node.items()
    if kind == "json":
        return body
    if kind == "array":
        if not isinstance(body, str):
            raise FormatError(f"{where}: 'array' must name an array path, found {_short(body)}")
        return load_array(body)
    if kind == "packed":
        if not isinstance(body, dict) or not isinstance(body.get("pack"), str):
            raise FormatError(f"{where}: 'packed' must describe a slice of a pack array")
        return load_array(body)
    if kind == "float":
        if body not in ("nan", "inf", "-inf"):
            raise FormatError(f"{where}: 'float' must be nan, inf or -inf, found {_short(body)}")
        return float(body)
    if kind in ("list", "tuple"):
        if not isinstance(body, list):
            raise FormatError(f"{where}: {kind!r} must hold a list")
        items = [decode_tree(v, load_array, f"{where}[{i}]", _depth + 1) for i, v in enumerate(body)]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        if not isinstance(body, list):
            raise FormatError(f"{where}: 'dict' must hold a list of [key, node] pairs")
        out: dict = {}
        for pair in body:
            if (
                not isinstance(pair, list)
                or len(pair) != 2
                or isinstance(pair[0], bool)
                or not isinstance(pair[0], (str, int))
            ):
                raise FormatError(f"{where}: bad dict entry {_short(pair)}")
            if pair[0] in out:
                raise FormatError(f"{where}: duplicate key {_short(pair[0])}")
            out[pair[0]] = decode_tree(pair[1], load_array, f"{where}/{pair[0]}", _depth + 1)
        return out
    raise FormatError(f"{where}: unknown node kind {_short(kind)}")


def set_at(root: Any, path: KeyPath, value: Any) -> Any:
    """Set ``root[path] = value`` in place; tuples on the way are rebuilt. Returns root."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    child = set_at(root[head], rest, value) if rest else value
    if isinstance(root, tuple):
        as_list = list(root)
        as_list[head] = child
        return type(root)(as_list) if type(root) is tuple else type(root)(*as_list)
    root[head] = child
    return root
