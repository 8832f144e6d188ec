"""The location of a checkpoint and its commit (spec §7), run by rank 0.

On a local file system a save never writes into the path it commits to:

1. :func:`begin` (under a lock on the parent directory) refuses a committed
   checkpoint without ``overwrite`` and anything foreign; if the path is empty,
   absent or an interrupted save, it *claims* it with a pending root
   ``zarr.json`` holding this save's id. It then creates the save's own
   directory next to it, ``.<name>.zarrckpt-<save_id>``, where every rank writes.
2. :func:`publish` writes the committed root into that directory, then (under
   the lock again) checks the path: still this save's claim, or (with
   ``overwrite``) a committed checkpoint → the directory is moved into place in
   one atomic step (``renameat2(RENAME_EXCHANGE)``), and what was there is
   deleted afterwards. Another save's claim, or a checkpoint committed meanwhile
   without ``overwrite``, fails this save with :class:`ConcurrentSaveError`.

So an old checkpoint stays loadable until the new one replaces it, two saves
never write into one directory, and an interrupted save leaves the path as it
was (or a pending claim), plus a hidden directory next to it.

Object stores cannot move a prefix: there the save writes in place. The claim
is a conditional write (of two saves starting at once, one fails); an
unfinished save's location is taken over only with ``overwrite`` (its late
writes would otherwise mix into this save's); an overwrite un-commits the old
root and deletes the old keys except the root (so the location stays an
interrupted save, reusable with ``overwrite``), and the commit is a conditional
write that succeeds only while the root is still this save's pending one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from . import format as fmt
from ._io import wait_all
from .errors import CheckpointExistsError, ConcurrentSaveError
from .storage import Storage

log = logging.getLogger("zarrckpt")

__all__ = ["Target", "abandon", "begin", "encode", "publish", "staging_name"]


def encode(doc: dict[str, Any]) -> bytes:
    """The exact bytes of a stored JSON document."""
    encoder = getattr(fmt, "encode_document", None)
    if encoder is not None:
        return encoder(doc)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def staging_name(name: str, save_id: str) -> str:
    """The directory a save writes into, next to its path (spec §7.3)."""
    return f".{name}.zarrckpt-{save_id}"


@dataclass
class Target:
    """Where a save writes (``store``) and what it commits to (``location``)."""

    location: Storage
    store: Storage
    save_id: str
    overwrite: bool
    claimed: bool = False  # the location holds this save's pending claim
    generation: bytes = b""  # the pending root's generation (in-place saves)

    @property
    def in_place(self) -> bool:
        return self.store is self.location


def _state(st: Storage) -> tuple[str, dict]:
    """('absent' | 'empty' | 'foreign' | 'pending' | 'committed', zarrckpt attributes)."""
    if not st.exists():
        return "absent", {}
    data, _ = st.read_bytes("zarr.json")
    return _classify(st, data)


def _classify(st: Storage, data: bytes | None) -> tuple[str, dict]:
    try:
        root = json.loads(data) if data is not None else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        root = None  # unreadable: not something we may replace
    attrs = root.get("attributes") if isinstance(root, dict) else None
    attrs = attrs.get(fmt.ATTR) if isinstance(attrs, dict) else None
    if isinstance(attrs, dict) and attrs.get("format") == fmt.FORMAT_NAME:
        return ("committed" if attrs.get("state") == "committed" else "pending"), attrs
    if data is None and st.is_empty():
        return "empty", {}
    return "foreign", {}


def _refuse(st: Storage, state: str, attrs: dict, overwrite: bool) -> None:
    if state == "committed" and not overwrite:
        raise CheckpointExistsError(
            f"a complete checkpoint exists at {st.url!r} (saved {attrs.get('created')}); "
            "pass overwrite=True to replace it")
    if state == "foreign":
        raise CheckpointExistsError(
            f"{st.url!r} exists, is not empty and is not a zarrckpt checkpoint; refusing to "
            "write into it (choose an empty or new path)")


def begin(location: Storage, save_id: str, overwrite: bool, pending_root: dict,
          groups: list[str]) -> Target:
    """Rank 0, before any rank writes: check the location, claim it, and create the
    directory of this save with its pending root and group documents."""
    pending = encode(pending_root)
    if location.can_rename:
        with location.parent_lock():
            state, attrs = _state(location)
            _refuse(location, state, attrs, overwrite)
            claimed = state != "committed"
            if claimed:  # absent, empty or an interrupted save: mark it as ours
                location.make_dir()
                location.write_atomic("zarr.json", pending)
        target = Target(location, location.sibling(staging_name(location.name, save_id)), save_id,
                        overwrite, claimed)
        try:
            target.store.make_dir()
            target.store.write_atomic("zarr.json", pending)
            _write_groups(target, groups)
        except BaseException:
            abandon(target)
            raise
        return target
    else:
        data, generation = location.read_bytes("zarr.json")
        state, attrs = _classify(location, data)
        _refuse(location, state, attrs, overwrite)
        if state == "pending" and not overwrite:
            # In place, a save that takes over a location whose save is still running would
            # get that save's late chunk writes mixed into its own: only with overwrite=True
            # (the caller asserts that the other save is dead).
            raise CheckpointExistsError(
                f"an unfinished save (id {attrs.get('save_id')}, started {attrs.get('created')}) "
                f"holds {location.url!r}; if it is no longer running, pass overwrite=True to "
                "replace it")
        # claim with a conditional write: of two saves starting at once, one fails here
        if not location.write_atomic("zarr.json", pending, if_equal=generation):
            raise ConcurrentSaveError(f"another save claimed {location.url!r} at the same moment; "
                                      "this save wrote nothing")
        if state in ("committed", "pending"):
            # the old checkpoint is un-committed (durably) before anything is deleted, and the
            # root stays: a crash anywhere leaves an interrupted save, which any later save
            # may reuse
            location.flush()
            location.clear(keep=("zarr.json",))
        target = Target(location, location, save_id, overwrite, True)
        _, target.generation = location.read_bytes("zarr.json")
        _write_groups(target, groups)
    return target


def _write_groups(target: Target, groups: list[str]) -> None:
    wait_all([(grp, target.store.put(f"{grp}/zarr.json", encode(fmt.group_metadata()))) for grp in groups],
             "write")


def publish(target: Target, committed_root: dict) -> None:
    """Rank 0, after every rank's writes are durable: make the checkpoint visible."""
    data = encode(committed_root)
    loc = target.location
    if target.in_place:
        if not loc.write_atomic("zarr.json", data, if_equal=target.generation):
            raise ConcurrentSaveError(
                f"another save took over {loc.url!r} while this one was writing; this save was "
                "not committed (the other save's root was left as it is)")
        loc.flush()
        return
    target.store.write_atomic("zarr.json", data)
    target.store.flush()
    with loc.parent_lock():
        state, attrs = _state(loc)
        if state == "pending" and attrs.get("save_id") != target.save_id:
            raise ConcurrentSaveError(
                f"another save (id {attrs.get('save_id')}) claimed {loc.url!r} while this one "
                f"(id {target.save_id}) was writing; this save was not committed")
        if state == "committed" and not target.overwrite:
            raise ConcurrentSaveError(
                f"another save committed a checkpoint at {loc.url!r} (saved {attrs.get('created')}) "
                "while this one was writing; this save was not committed (pass overwrite=True "
                "to replace it)")
        if state == "foreign":
            raise ConcurrentSaveError(f"{loc.url!r} was filled with other data while this save was "
                                      "writing; this save was not committed")
        old = target.store.move_to(loc)
    if old is not None:
        try:
            old.remove()
        except Exception as e:  # noqa: BLE001 - the commit stands; only space is lost
            log.warning("zarrckpt: committed %s, but could not delete the replaced data at %s: %s",
                        loc.url, old.url, e)


def abandon(target: Target | None) -> None:
    """Rank 0, after a failed save (every rank has stopped writing): delete this save's
    directory and its claim, so the location is as it was before the save."""
    if target is None or target.in_place:
        return  # in place: the pending root stays (an interrupted save, reusable)
    try:
        target.store.remove()
        if target.claimed:
            with target.location.parent_lock():
                state, attrs = _state(target.location)
                loc = target.location
                if (state == "pending" and attrs.get("save_id") == target.save_id
                        and loc.local_path is not None and _only_root(loc)):
                    loc.remove()
    except Exception as e:  # noqa: BLE001 - the save failed already; say what is left
        log.warning("zarrckpt: could not clean up after a failed save to %s: %s", target.location.url, e)


def _only_root(st: Storage) -> bool:
    import os

    return os.listdir(st.local_path) == ["zarr.json"]

