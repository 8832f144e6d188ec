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

Escaping is injective, so distinct keys never share an array, and no key can
name anything outside the checkpoint directory.

This module is pure Python: leaves are classified by a caller-supplied
function so that torch stays out of it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

from .errors import FormatError, UnsupportedValueError

__all__ = [
    "KeyPath",
    "decode_tree",
    "encode_tree",
    "escape",
    "flatten",
    "key_of",
    "set_at",
    "unescape",
]

KeyPath = tuple  # tuple[str | int, ...]

_SAFE = re.compile(r"[A-Za-z0-9._-]")
_MAX_COMPONENT_BYTES = 255  # common file-system limit on one path component


def escape(component: str | int) -> str:
    """Escape one key-path component into one storage path segment."""
    if isinstance(component, bool) or not isinstance(component, (str, int)):
        raise UnsupportedValueError(
            f"dict key {component!r} of type {type(component).__name__}: keys must be str or int"
        )
    if isinstance(component, int):
        s = str(component)
        if len(s) > _MAX_COMPONENT_BYTES:
            raise UnsupportedValueError(f"integer key of {len(s)} digits is too long for a path segment")
        return s
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
    if len(s.encode()) > _MAX_COMPONENT_BYTES:
        raise UnsupportedValueError(
            f"key component {component[:40]!r}... escapes to {len(s.encode())} bytes; "
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
    return raw.decode("utf-8")


def key_of(path: KeyPath) -> str:
    """The user-facing key (= array path) of a key path."""
    return "/".join(escape(c) for c in path)


# --------------------------------------------------------------------------- flatten


def flatten(
    obj: Any, is_array: Callable[[Any], bool], prefix: KeyPath = ()
) -> Iterator[tuple[KeyPath, Any]]:
    """Yield ``(key path, leaf)`` for every leaf of a nested dict/list/tuple.

    Leaves are arrays (``is_array``), ``bytes`` and JSON scalars. Containers
    are dicts with str/int keys, lists and tuples; an empty container is a
    leaf of its own (so both sides of a load agree on it).
    """
    if isinstance(obj, dict) and (obj or not prefix):
        for k, v in obj.items():
            escape(k)  # validates the key type early
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
#       | {"array": "<array path>"}        tensor, bytes or ndarray stored as an array
#       | {"packed": {"pack", "offset", "nbytes", "kind", "data_type", "shape"}}
#                                          a small one stored inside a pack array
#       | {"json": <JSON value>}           a subtree of plain JSON (finite floats only)
#       | {"float": "nan" | "inf" | "-inf"}


def _is_plain_json(obj: Any) -> bool:
    if obj is None or isinstance(obj, (bool, int, str)):
        return True
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, list):
        return all(_is_plain_json(v) for v in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _is_plain_json(v) for k, v in obj.items())
    return False


def _describe(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def encode_tree(
    obj: Any, is_array: Callable[[Any], bool], prefix: KeyPath = ()
) -> dict[str, Any]:
    """The stored ``tree`` node of ``obj``; array leaves become ``{"array": key}``."""
    if is_array(obj) or isinstance(obj, (bytes, bytearray, memoryview)):
        return {"array": key_of(prefix)}
    if _is_plain_json(obj) and not (isinstance(obj, dict) and not prefix):
        return {"json": obj}
    if isinstance(obj, float):
        return {"float": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, dict):
        seen: dict[str, Any] = {}
        items = []
        for k, v in obj.items():
            seg = escape(k)
            if seg in seen:
                raise UnsupportedValueError(
                    f"keys {seen[seg]!r} and {k!r} under {key_of(prefix) or '<root>'!r} "
                    f"map to the same stored name {seg!r}"
                )
            seen[seg] = k
            items.append([k, encode_tree(v, is_array, prefix + (k,))])
        return {"dict": items}
    if isinstance(obj, (list, tuple)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return {kind: [encode_tree(v, is_array, prefix + (i,)) for i, v in enumerate(obj)]}
    raise UnsupportedValueError(
        f"cannot store the value at key {key_of(prefix)!r}: type {_describe(obj)} is not a "
        "tensor, bytes, or JSON-able value (int, float, bool, str, None, list/tuple/dict of "
        "them). zarrckpt never pickles: convert it yourself (e.g. to bytes or a dict), or give "
        "it state_dict()/load_state_dict() methods."
    )


def decode_tree(node: Any, load_array: Callable[[str], Any], where: str = "tree") -> Any:
    """Rebuild the nested object; ``load_array(key)`` supplies array leaves."""
    if not isinstance(node, dict) or len(node) != 1:
        raise FormatError(f"{where}: expected an object with exactly one member, found {node!r:.80}")
    ((kind, body),) = node.items()
    if kind == "json":
        return body
    if kind == "array":
        if not isinstance(body, str):
            raise FormatError(f"{where}: 'array' must name an array path, found {body!r:.80}")
        return load_array(body)
    if kind == "packed":
        if not isinstance(body, dict) or not isinstance(body.get("pack"), str):
            raise FormatError(f"{where}: 'packed' must describe a slice of a pack array")
        return load_array(body)
    if kind == "float":
        if body not in ("nan", "inf", "-inf"):
            raise FormatError(f"{where}: 'float' must be nan, inf or -inf, found {body!r}")
        return float(body)
    if kind in ("list", "tuple"):
        if not isinstance(body, list):
            raise FormatError(f"{where}: {kind!r} must hold a list")
        items = [decode_tree(v, load_array, f"{where}[{i}]") for i, v in enumerate(body)]
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
                raise FormatError(f"{where}: bad dict entry {pair!r:.80}")
            if pair[0] in out:
                raise FormatError(f"{where}: duplicate key {pair[0]!r}")
            out[pair[0]] = decode_tree(pair[1], load_array, f"{where}/{pair[0]}")
        return out
    raise FormatError(f"{where}: unknown node kind {kind!r}")


def tree_keys(node: Any, prefix: KeyPath = ()) -> Iterator[tuple[KeyPath, dict[str, Any]]]:
    """Yield ``(key path, leaf node)`` of a stored tree, descending into plain JSON too."""
    ((kind, body),) = node.items()
    if kind in ("dict", "list", "tuple") and not body and prefix:
        yield prefix, node  # an empty container is a leaf, as in flatten()
    elif kind == "dict":
        for k, v in body:
            yield from tree_keys(v, prefix + (k,))
    elif kind in ("list", "tuple"):
        for i, v in enumerate(body):
            yield from tree_keys(v, prefix + (i,))
    elif kind == "json" and isinstance(body, (dict, list)) and body:
        items = body.items() if isinstance(body, dict) else enumerate(body)
        for k, v in items:
            yield from tree_keys({"json": v}, prefix + (k,))
    else:
        yield prefix, node


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
