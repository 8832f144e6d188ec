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
from ._io import InFlight
from .reader import Checkpoint
from .staging import Arena, sync_devices
from .storage import Array
from .storage._tensorstore import translate_error

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
    max_staging_bytes: int = 1 << 30,
    max_inflight_bytes: int = 256 << 20,
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
    reader = _Reads(ckpt, max_staging_bytes, max_inflight_bytes)
    todo = []
    for kp, leaf, ck in tensor_targets:
        boxes, local = _target_boxes(leaf, g)
        if local is not None and boxes:
            todo.append((ck, boxes, local))
    reader.open({ck for ck, _, _ in todo}, infos)
    for ck, boxes, local in todo:
        reader.add(ck, infos[ck], boxes, local)
    reader.finish()
    t_read = time.perf_counter() - t1

    # ---- values and Stateful --------------------------------------------------
    for kp, leaf, ck in targets:
        if isinstance(leaf, torch.Tensor):
            continue
        resolved = ztree.set_at(resolved, kp, _load_value(ckpt, ck))
    _apply(state_dict, resolved)
    rep = {"path": ckpt.url, "rank": g.rank, "bytes_needed": reader.bytes_needed,
           "bytes_fetched": reader.bytes_fetched,
           "missing": missing, "unexpected": unexpected,
           "seconds": {"plan": t_plan, "read": t_read, "total": time.perf_counter() - t0}}
    log.info("zarrckpt load %s: %s", ckpt.url, rep)
    if report is not None:
        report.update(rep)
    return state_dict


class _Reads:
    """Region reads of one load: straight into CPU targets of the saved dtype; through a
    bounded (pinned) arena for device targets and casts, batch by batch."""

    def __init__(self, ckpt: Checkpoint, max_staging_bytes: int, max_inflight_bytes: int) -> None:
        self.ckpt = ckpt
        self.arena = None
        self.max_staging_bytes = max_staging_bytes
        self.arrays: dict[str, Any] = {}
        self.pending = InFlight(max_inflight_bytes)  # reads in flight
        self.batch: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, staged) to copy
        self.bytes_needed = 0
        self.bytes_fetched = 0

    def open(self, keys: set[str], infos: dict) -> None:
        """Open every array at once (metadata already read: no I/O)."""
        st = self.ckpt.storage
        futs = {k: st.open_for_read(self.ckpt.node(k)["array"], infos[k].metadata)
                for k in keys if not self.ckpt.is_packed(k)}
        for k, f in futs.items():
            try:
                self.arrays[k] = Array(f.result(), k)
            except Exception as e:  # noqa: BLE001
                raise translate_error(e, k) from e

    def add(self, key: str, info: Any, boxes: list, local: torch.Tensor) -> None:
        saved = dtypes.torch_dtype(info.dtype)
        if local.device.type == "cpu" and local.dtype == saved:
            dst = dtypes.to_numpy(local.detach())
        else:
            dst = self._staging(tuple(local.shape), saved, local)
        if self.ckpt.is_packed(key):  # small: the whole leaf comes from its (cached) pack
            full = self.ckpt.read(key)
            for gbox, lbox in boxes:
                view = dst[tuple(slice(a, b) for a, b in lbox)] if lbox else dst
                view[...] = full[tuple(slice(a, b) for a, b in gbox)] if gbox else full
                self.bytes_needed += view.nbytes
                self.bytes_fetched += view.nbytes
            return
        arr = self.arrays[key]
        inner = _read_unit(info)
        for gbox, lbox in boxes:
            if any(a == b for a, b in gbox):
                continue
            view = dst[tuple(slice(a, b) for a, b in lbox)] if lbox else dst
            self.pending.add(key, arr.read_into(gbox, view), view.nbytes)
            self.bytes_needed += view.nbytes
            self.bytes_fetched += _fetched(gbox, inner, info.shape) * view.itemsize

    def _staging(self, shape, dtype, target: torch.Tensor) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        if self.arena is None:
            self.arena = Arena(self.max_staging_bytes)
        if nbytes > self.arena.capacity:
            buf = torch.empty(shape, dtype=dtype, pin_memory=self.arena.pinned)
        else:
            if not self.arena.fits(nbytes):
                self._flush()
            buf = self.arena.take(shape, dtype)
        self.batch.append((target, buf))
        return dtypes.to_numpy(buf)

    def _flush(self) -> None:
        self.pending.wait()
        with torch.no_grad():
            for target, buf in self.batch:
                target.copy_(buf, non_blocking=True)
        sync_devices([t for t, _ in self.batch])
        self.batch.clear()
        if self.arena is not None:
            self.arena.reset()

    def finish(self) -> None:
        self._flush()


def _read_unit(info: Any) -> tuple[int, ...]:
    """The smallest unit a reader fetches: the inner chunk when sharded, else the chunk."""
    for c in info.metadata.get("codecs", []):
        if c.get("name") == "sharding_indexed":
            return tuple(c["configuration"]["chunk_shape"])
    return info.chunk_shape


def _fetched(box, unit, shape) -> int:
    n = 1
    for (a, b), u, size in zip(box, unit, shape):
        n *= min(-(-b // u) * u, size) - (a // u) * u
    return n


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
