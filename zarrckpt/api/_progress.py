"""The ``progress=`` argument of save, async_save and load: a callback, or a tqdm bar.

``progress(phase, done_bytes, total_bytes)`` is called with this rank's bytes:

* save and async_save: ``"write"`` -- chunk bytes handed to storage (at most
  ``max_inflight_bytes`` ahead of those on storage), first with ``done_bytes=0``, then
  after each chunk, and once more when every write is durable; then ``"commit"`` once,
  with ``done_bytes == total_bytes``, when the checkpoint is committed.
* load: ``"read"`` -- bytes of stored data read into this rank's targets (the same
  bound ahead of completed reads), first with 0, then as each piece is issued, and once
  more when every read is done; then ``"apply"`` once, with ``done_bytes ==
  total_bytes``, when the values are in place.

``progress=True`` shows a tqdm bar on stderr on rank 0 (other ranks show none);
``None``/``False`` (the default): nothing, and no per-chunk work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import MissingDependencyError

__all__ = ["ProgressFn", "close", "resolve"]

ProgressFn = Callable[[str, int, int], None]

# the command that installs tqdm (zarrckpt is installed from its repository: the extra is
# `pip install -e '.[progress]'` there)
INSTALL = "pip install tqdm"


def resolve(progress: Any, what: str, rank: int) -> ProgressFn | None:
    """The callback for ``progress`` (None: report nothing). ``True``: a tqdm bar on rank 0,
    tqdm imported now, so that a missing tqdm fails the call before anything is done."""
    if progress is None or progress is False:
        return None
    if progress is True:
        bar = _Bar(what)  # on every rank: a missing tqdm fails every rank alike, before the entry check
        return bar if rank == 0 else None
    if callable(progress):
        return progress
    raise ValueError(f"progress must be a callable(phase, done_bytes, total_bytes), True (a progress "
                     f"bar) or None, not {progress!r}")


def close(fn: ProgressFn | None) -> None:
    """Close the bar of ``progress=True`` (after a failure too); nothing for a callback."""
    if isinstance(fn, _Bar):
        fn.close()


class _Bar:
    """``progress=True``: one tqdm bar of bytes, its description naming the phase."""

    def __init__(self, what: str) -> None:
        try:
            from tqdm.auto import tqdm
        except ImportError as e:
            raise MissingDependencyError(
                f"zarrckpt.{what}(progress=True) needs tqdm, which is not installed; install it "
                f"({INSTALL}), or pass progress=callable(phase, done_bytes, total_bytes)", "tqdm") from e
        self._tqdm = tqdm
        self.what = what
        self.bar: Any = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = self._tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                  desc=f"zarrckpt {self.what}")
        bar = self.bar
        if bar.total != total:
            bar.total = total
        bar.set_postfix_str(phase, refresh=False)
        bar.update(done - bar.n)
        if phase in ("commit", "apply"):
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
