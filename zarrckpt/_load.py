"""Loading in place, with resharding. No collectives: every rank plans from the
checkpoint's metadata and its own target tensors, then reads only the boxes its
local shards cover.

Order: read root + array metadata -> validate every key, shape and dtype
(nothing is touched before all of it passes) -> issue every region read at
once, straight into the target's memory when it is a CPU tensor of the saved
dtype, else into a host buffer then ``copy_`` -> set non-tensor values ->
``load_state_dict`` on Stateful leaves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from . import dist as zdist
from . import dtypes
from . import tree as ztree
from ._save import is_array_leaf, is_stateful, resolve_stateful
from .errors import (
    DTypeMismatchError,
    MissingKeysError,
    ShapeMismatchError,
    StateDictMismatchError,
    UnexpectedKeysError,
)
from .layout import Layout, Replicate
from .reader import Checkpoint, wait_all

log = logging.getLogger("zarrckpt")

__all__ = ["load", "load_state_dict"]

KeyMap = Mapping[str, str] | Callable[[str], str] | None


def _mapper(key_map: KeyMap) -> Callable[[str], str]:
    if key_map is None:
        return lambda k: k
    if callable(key_map):
        return key_map
    return lambda k: key_map.get(k, k)


def _fmt_keys(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def load(
    state_dict: dict,
    path: Any,
    *,
    process_group: Any = None,
    strict: bool = True,
    key_map: KeyMap = None,
    cast: bool = False,
    report: dict | None = None,
) -> dict:
    t0 = time.perf_counter()
    ckpt = Checkpoint(path)
    g = zdist.group(process_group)
    resolved = resolve_stateful(state_dict)
    mapped = _mapper(key_map)

    targets = []  # (key path, target leaf, checkpoint key)
    seen = set()
    missing = []
    for kp, leaf in ztree.flatten(resolved, is_array_leaf):
        tkey = ztree.key_of(kp)
        ckey = mapped(tkey)
        if ckey not in ckpt:
            missing.append(tkey if ckey == tkey else f"{tkey} (-> {ckey})")
            continue
        seen.add(ckey)
        targets.append((kp, leaf, ckey))
    unexpected = [k for k in ckpt.keys() if k not in seen]
    if strict and missing:
        raise MissingKeysError(
            f"{len(missing)} key(s) of the target are not in checkpoint {ckpt.url!r}: "
            f"{_fmt_keys(missing)} (pass strict=False to leave them as they are, or key_map=)"
        )
    if strict and unexpected:
        raise UnexpectedKeysError(
            f"checkpoint {ckpt.url!r} holds {len(unexpected)} key(s) the target lacks: "
            f"{_fmt_keys(unexpected)} (pass strict=False to ignore them)"
        )

    # ---- validate everything before touching anything ------------------------
    tensor_targets = [(kp, leaf, ck) for kp, leaf, ck in targets if isinstance(leaf, torch.Tensor)]
    for kp, leaf, ck in tensor_targets:
        if not ckpt.is_array(ck):
            raise StateDictMismatchError(
                f"key {ztree.key_of(kp)!r}: the target is a tensor but the checkpoint holds a "
                f"{type(ckpt.read(ck)).__name__} value"
            )
    infos = ckpt.array_infos([ck for _, _, ck in tensor_targets])
    for kp, leaf, ck in tensor_targets:
        info = infos[ck]
        where = ztree.key_of(kp) + (f" (checkpoint key {ck!r})" if ck != ztree.key_of(kp) else "")
        if info.kind == "bytes":
            raise StateDictMismatchError(f"tensor {where}: the checkpoint holds bytes there")
        if tuple(leaf.shape) != info.shape:
            raise ShapeMismatchError(
                f"tensor {where!r}: saved shape {info.shape}, target {tuple(leaf.shape)}"
            )
        saved = dtypes.torch_dtype(info.dtype)
        if saved != leaf.dtype and not cast:
            raise DTypeMismatchError(
                f"tensor {where!r}: saved dtype {saved}, target {leaf.dtype} "
                "(pass cast=True to convert)"
            )
    t_plan = time.perf_counter() - t0

    # ---- read ------------------------------------------------------------------
    t1 = time.perf_counter()
    futures, copies, nbytes = [], [], 0
    arrays = {}
    for kp, leaf, ck in tensor_targets:
        info = infos[ck]
        boxes, local = _target_boxes(leaf, g)
        if local is None:
            continue
        if ck not in arrays:
            arrays[ck] = ckpt.open_array(ck)
        arr = arrays[ck]
        direct = local.device.type == "cpu" and local.dtype == dtypes.torch_dtype(info.dtype)
        if direct:
            dst = dtypes.to_numpy(local.detach())
        else:
            dst = np.empty(tuple(local.shape), dtype=info.dtype.numpy)
            copies.append((local, dst, info.dtype))
        for gbox, lbox in boxes:
            if any(a == b for a, b in gbox):
                continue
            view = dst[tuple(slice(a, b) for a, b in lbox)] if lbox else dst
            futures.append((ck, arr.read_into(gbox, view)))
            nbytes += view.nbytes
    wait_all(futures)
    with torch.no_grad():
        for local, buf, row in copies:
            local.copy_(dtypes.from_numpy(buf, row))
    t_read = time.perf_counter() - t1

    # ---- values and Stateful --------------------------------------------------
    for kp, leaf, ck in targets:
        if isinstance(leaf, torch.Tensor):
            continue
        resolved = ztree.set_at(resolved, kp, _load_value(ckpt, ck))
    _apply(state_dict, resolved)
    rep = {"path": ckpt.url, "rank": g.rank, "bytes_read": nbytes,
           "missing": missing, "unexpected": unexpected,
           "seconds": {"plan": t_plan, "read": t_read, "total": time.perf_counter() - t0}}
    log.info("zarrckpt load %s: %s", ckpt.url, rep)
    if report is not None:
        report.update(rep)
    return state_dict


def _load_value(ckpt: Checkpoint, key: str) -> Any:
    if not ckpt.is_array(key):
        return ckpt.read(key)
    info = ckpt.array_info(key)
    data = ckpt.read(key)
    if info.kind in ("bytes", "ndarray"):
        return data
    return dtypes.from_numpy(data, info.dtype)


def _target_boxes(leaf: torch.Tensor, g: zdist.Group):
    """(global box, local box) pairs the target needs, and its local tensor (None: not held)."""
    if zdist.is_dtensor(leaf):
        mesh_shape, _, placements, _, _, coord = zdist.dtensor_info(leaf)
        if coord is None:
            return [], None
        layout = Layout(tuple(leaf.shape), mesh_shape, placements)
        local = leaf._local_tensor if hasattr(leaf, "_local_tensor") else leaf.to_local()
        if tuple(local.shape) != layout.local_shape(coord):
            raise StateDictMismatchError(
                f"DTensor local shape {tuple(local.shape)} differs from "
                f"{layout.local_shape(coord)} computed from {leaf.placements}"
            )
        return list(layout.local_boxes(coord)), local
    layout = Layout(tuple(leaf.shape), (1,), (Replicate(),))
    return list(layout.local_boxes((0,))), leaf


def _apply(orig: Any, res: Any) -> Any:
    """Write loaded values back into the caller's structure; Stateful gets load_state_dict."""
    if is_stateful(orig):
        orig.load_state_dict(res)
        return orig
    if isinstance(orig, dict) and isinstance(res, dict):
        for k in orig:
            if k in res:
                orig[k] = _apply(orig[k], res[k])
        return orig
    if isinstance(orig, list) and isinstance(res, (list, tuple)) and len(orig) == len(res):
        for i in range(len(orig)):
            orig[i] = _apply(orig[i], res[i])
        return orig
    if isinstance(orig, tuple) and isinstance(res, (list, tuple)) and len(orig) == len(res):
        return type(orig)(_apply(o, r) for o, r in zip(orig, res))
    if isinstance(orig, torch.Tensor) and orig is res:
        return orig
    return res


def load_state_dict(path: Any, keys: list[str] | None = None) -> dict:
    """The whole checkpoint (or the keys/prefixes asked for) as plain CPU tensors."""
    ckpt = Checkpoint(path)

    def load_array(key: str) -> Any:
        return _load_value(ckpt, key)

    return ckpt.to_dict(keys, load_array)
