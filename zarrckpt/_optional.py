"""Optional dependencies: one error that names the missing package and the extra that
installs it, instead of a bare ``ModuleNotFoundError`` from deep inside a call.

zarrckpt needs only NumPy, ml_dtypes, TensorStore and zarr to *read*. torch (saving,
loading into tensors), jax (``zarrckpt.jax``), dask and xarray (``LazyArray.dask()``,
``zarrckpt.open_run``) are imported only by the calls that use them.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from .errors import MissingDependencyError

__all__ = ["MissingDependencyError", "needs_torch", "require"]

# module -> (pip extra of zarrckpt, what to install)
_EXTRAS = {
    "torch": ("torch", "torch>=2.6"),
    "jax": ("jax", "jax"),
    "dask": ("dask", "dask[array]"),
    "xarray": ("xarray", "xarray and dask[array]"),
    "matplotlib": ("plot", "matplotlib"),
}


def require(module: str, what: str) -> ModuleType:
    """``import module`` for the call ``what``, or raise :class:`MissingDependencyError`
    saying which package and which zarrckpt extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        extra, pip_name = _EXTRAS.get(top, (None, top))
        how = f"pip install 'zarrckpt[{extra}]'" if extra else f"pip install {pip_name}"
        found = "is not installed" if isinstance(e, ModuleNotFoundError) and e.name == top \
            else f"cannot be imported ({e})"
        raise MissingDependencyError(f"{what} needs {top}, which {found}; install {pip_name} "
                                     f"({how})", top) from e


F = TypeVar("F", bound=Callable[..., Any])


def needs_torch(fn: F) -> F:
    """Wrap a torch-only public function: without torch it raises
    :class:`MissingDependencyError` naming the function, before anything else runs."""
    what = f"zarrckpt.{fn.__name__}"

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        require("torch", what)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
