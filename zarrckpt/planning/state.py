"""State dicts as zarrckpt sees them: Stateful objects, array leaves, and the checks
every leaf passes before a save touches storage (or a load touches a target)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from ..distributed import group as zdist
from ..format import dtypes
from ..format import tree as ztree
from ..errors import UnsupportedValueError

__all__ = ["checked_dtype", "checked_target", "checked_tensor", "is_array_leaf", "is_stateful",
           "needs_initialized_state", "owner_of", "resolve_stateful"]


def is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, (dict, list, tuple, torch.Tensor))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def resolve_stateful(obj: Any, depth: int = 0, *, path: ztree.KeyPath = (),
                     found: dict[ztree.KeyPath, Any] | None = None) -> Any:
    """A copy of the nested containers with every Stateful replaced by its state_dict().
    Nesting deeper than the format allows (``tree.MAX_DEPTH``) is refused here, before
    anything else looks at the state. ``found``: filled with ``{key path: Stateful}``."""
    if depth > ztree.MAX_DEPTH:
        raise UnsupportedValueError(
            f"the state dict is nested more than {ztree.MAX_DEPTH} levels deep (the format's "
            "limit, spec §6.2); flatten it, or store the deep part as bytes")
    if is_stateful(obj):
        if found is not None:
            found[path] = obj
        return resolve_stateful(obj.state_dict(), depth, path=path, found=found)
    if isinstance(obj, dict):
        return {k: resolve_stateful(v, depth + 1, path=path + (k,), found=found) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve_stateful(v, depth + 1, path=path + (i,), found=found) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(resolve_stateful(v, depth + 1, path=path + (i,), found=found) for i, v in enumerate(obj))
    return obj


def owner_of(found: dict[ztree.KeyPath, Any], path: ztree.KeyPath) -> Any:
    """The innermost Stateful (of ``resolve_stateful``'s ``found``) whose state holds ``path``, or None."""
    best = max((p for p in found if path[:len(p)] == p), key=len, default=None)
    return None if best is None else found[best]


def needs_initialized_state(obj: Any) -> bool:
    """A torch optimizer over DTensor (FSDP2, TP) or FSDP1 flat parameters: its state is
    sharded like its parameters, so state it does not have yet cannot be made from the
    checkpoint's global arrays alone."""
    if not isinstance(obj, torch.optim.Optimizer):
        return False
    return any(zdist.is_dtensor(p) or type(p).__name__ == "FlatParameter"
               for group in obj.param_groups for p in group["params"])


def is_array_leaf(obj: Any) -> bool:
    return isinstance(obj, (torch.Tensor, np.ndarray, bytes, bytearray, memoryview, io.BytesIO))


def checked_dtype(dtype: Any, key: str) -> dtypes.DType:
    """The dtype's table row, or UnsupportedValueError naming the key."""
    try:
        return dtypes.by_torch(dtype) if isinstance(dtype, torch.dtype) else dtypes.by_numpy(dtype)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"tensor {key!r}: {e}") from None


def checked_tensor(t: torch.Tensor, key: str, *, what: str = "tensor") -> torch.Tensor:
    """A plain strided tensor holding ``t``'s values, or an error naming ``key``.

    Refused: sparse, nested, quantized and meta tensors (no stored form, or no data).
    Conjugate/negative views are resolved (a copy, only for such views)."""
    if zdist.is_dtensor(t) or zdist.is_sharded_tensor(t):
        raise AssertionError("pass the local tensor")  # pragma: no cover
    if t.is_nested:  # before the layout: a jagged nested tensor's layout is torch.jagged
        raise UnsupportedValueError(f"{what} {key!r}: nested tensors cannot be stored; store their "
                                    "components (.unbind()) or a padded tensor (.to_padded_tensor(0))")
    if t.layout != torch.strided:
        raise UnsupportedValueError(f"{what} {key!r}: {t.layout} tensors cannot be stored; "
                                    "call .to_dense() first")
    if t.is_quantized:
        raise UnsupportedValueError(f"{what} {key!r}: quantized tensors cannot be stored; "
                                    "call .dequantize() or store .int_repr() and the scales")
    if t.device.type == "meta":
        raise UnsupportedValueError(f"{what} {key!r} is on the meta device: it has no data to save")
    checked_dtype(t.dtype, key)
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def checked_target(t: torch.Tensor, key: str) -> None:
    """A (local) load target that can be read into in place, or UnsupportedValueError
    naming ``key`` and the reason: sparse, nested and quantized tensors (the layouts
    :func:`checked_tensor` refuses to save) have no dense memory of the saved shape."""
    if t.is_nested:
        raise UnsupportedValueError(f"load target {key!r} is a nested tensor: a checkpoint is loaded "
                                    "in place into dense (strided) tensors only")
    if t.layout != torch.strided:
        what = f"sparse tensor ({t.layout})" if "sparse" in str(t.layout) else f"{t.layout} tensor"
        raise UnsupportedValueError(
            f"load target {key!r} is a {what}: a checkpoint is loaded in place into "
            "dense (strided) tensors; pass a dense target (e.g. torch.empty(shape, dtype=...)) "
            "and convert it afterwards (.to_sparse())")
    if t.is_quantized:
        raise UnsupportedValueError(f"load target {key!r} is a quantized tensor: a checkpoint is loaded "
                                    "in place into dense (strided) tensors only; load into a float "
                                    "tensor and quantize it afterwards")
