"""The location of a checkpoint and its commit (spec §7), run by rank 0.

On a local file system a save never writes into the path it commits to:

1. :func:`begin` (under a lock on the parent directory) refuses a committed
   checkpoint without ``overwrite`` and anything foreign; if the path is empty,
   absent or an interrupted save, it *claims* it with a pending root
   ``zarr.json`` holding this save's id. It then creates the save's own
   directory next to it, ``.zarrckpt-<save_id>.<hex of name>``, where every rank writes.
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

Leftovers (spec §7.5). On a file system rank 0 holds an exclusive ``flock`` on
``.zarrckpt-<save_id>.<hex of name>.lock`` beside the location (:class:`SaveLock`) from
before its claim until its directory is gone; the kernel drops it when the
process dies, SIGKILL included. :func:`clean_leftovers` removes the hidden
directories, pending claims and lock files of saves whose lock it can take (or
whose lock file is gone), never those of a live save; :func:`begin` runs it for
its own path, so a retry removes what the dead save left. :func:`retire` deletes
a committed checkpoint so that a crash leaves no committed root over partial
data: rename aside (file systems) or un-commit (object stores) first, then delete.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field

from ..format import documents as fmt
from ..storage.inflight import wait_all
from ..errors import CheckpointExistsError, ConcurrentSaveError, StorageError
from ..storage import Storage, StorageOptions, open_storage, storage_error

log = logging.getLogger("zarrckpt")

__all__ = ["Leftover", "SaveLock", "Target", "abandon", "begin", "clean_leftovers", "publish",
           "retire", "save_store"]


def save_store(location: Storage, save_id: str) -> Storage:
    """Where the save ``save_id`` to ``location`` writes: its own directory beside the
    location on file systems (spec §7.3), the location itself on object stores."""
    return location.sibling(fmt.staging_name(location.name, save_id)) if location.can_rename else location




# a save's own directory (or the data it replaced, "-old" where exchange is unsupported)


@dataclass
class Target:
    """Where a save writes (``store``) and what it commits to (``location``)."""

    location: Storage
    store: Storage
    save_id: str
    overwrite: bool
    claimed: bool = False  # the location holds this save's pending claim
    generation: bytes = b""  # the pending root's generation (in-place saves)
    lock: SaveLock | None = field(default=None, repr=False)  # file systems: held until done

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
    """The location's state from its root's bytes (:func:`format.documents.root_state`),
    with 'empty' for a location that holds nothing at all."""
    state, attrs = fmt.root_state(data)
    if state == "absent":
        return ("empty" if st.is_empty() else "foreign"), {}
    return state, attrs


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
    pending = fmt.encode_document(pending_root)
    if location.can_rename:
        lock = SaveLock.acquire(location, save_id)  # before anything of this save exists
        try:
            _clean_quietly(location, save_id)  # what dead saves to this path left
            with location.parent_lock():
                state, attrs = _state(location)
                _refuse(location, state, attrs, overwrite)
                claimed = state != "committed"
                if claimed:  # absent, empty or an interrupted save: mark it as ours
                    location.make_dir()
                    location.write_atomic("zarr.json", pending)
        except BaseException:
            lock.release()
            raise
        target = Target(location, save_store(location, save_id), save_id, overwrite, claimed, lock=lock)
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
    doc = fmt.encode_document(fmt.group_metadata())
    wait_all([(grp, target.store.put(f"{grp}/zarr.json", doc)) for grp in groups], "write")


def publish(target: Target, committed_root: dict) -> None:
    """Rank 0, after every rank's writes are durable: make the checkpoint visible."""
    data = fmt.root_bytes(committed_root)
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
        except Exception as e:  # noqa: BLE001 - the commit stands; a later clean removes it
            log.warning("zarrckpt: committed %s, but could not delete the replaced data at %s: %s",
                        loc.url, old.url, e)
    if target.lock is not None:
        target.lock.release()


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
    finally:
        if target.lock is not None:
            target.lock.release()


def _only_root(st: Storage) -> bool:
    return os.listdir(st.local_path) == ["zarr.json"]


# ---- retiring a committed checkpoint ------------------------------------------------


def retire(location: Storage) -> None:
    """Delete the checkpoint at ``location`` so that no crash leaves a committed root over
    partly deleted data (spec §7.6). File systems: under a lock of its own, rename the
    directory to a hidden leftover name (one atomic step: the checkpoint is gone from the
    path), then delete it; a crash in between leaves a dead leftover. Object stores:
    rewrite the root as ``pending`` (conditionally, durably), then delete the other keys,
    then the root; a crash in between leaves an interrupted save."""
    if location.can_rename:
        retire_id = fmt.new_save_id()
        aside = location.sibling(fmt.staging_name(location.name, retire_id))
        lock = SaveLock.acquire(location, retire_id)
        try:
            with location.parent_lock():
                if not location.exists():
                    return
                try:
                    os.rename(location.local_path.rstrip("/"), aside.local_path.rstrip("/"))
                except OSError as e:
                    raise storage_error(f"moving {location.url!r} aside to delete it", e) from e
            aside.remove()
        finally:
            lock.release()
        return
    data, generation = location.read_bytes("zarr.json")
    if data is not None:
        state, attrs = _classify(location, data)
        if state == "committed":
            pending = fmt.root_metadata(state="pending", save_id=fmt.new_save_id(),
                                        world_size=attrs.get("world_size", 1), created=fmt.utc_now(),
                                        writer=attrs.get("writer") or {})
            if not location.write_atomic("zarr.json", fmt.encode_document(pending), if_equal=generation):
                raise ConcurrentSaveError(f"{location.url!r} changed while it was being deleted; "
                                          "it was left as it is")
            location.flush()
    location.clear(keep=("zarr.json",))
    location.remove()


# ---- liveness of saves, and their leftovers (file systems) -----------------------


class SaveLock:
    """Rank 0's exclusive ``flock`` on ``.zarrckpt-<id>.<hex of name>.lock`` beside the location,
    taken before any file of the save exists and released (the file deleted) after the
    save's directory is gone. The kernel releases it when the process dies, SIGKILL
    included, so a cleaner that can take it knows the save is dead (spec §7.5)."""

    def __init__(self, path: str, fd: int | None) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, location: Storage, save_id: str) -> SaveLock:
        import fcntl

        parent = os.path.dirname(location.local_path.rstrip("/"))
        path = os.path.join(parent, fmt.lock_name(location.name, save_id))
        for _ in range(100):
            try:
                os.makedirs(parent, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise storage_error(f"creating the lock file {path!r}", e) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:  # the file system has no flock: cleaners there cannot lock it either
                log.warning("zarrckpt: cannot lock %s (%s): cleaners on other hosts may take this save "
                            "for dead", path, e)
                return cls(path, fd)
            if _same_file(fd, path):
                return cls(path, fd)
            os.close(fd)  # a cleaner deleted the file between our open and our lock: again
        raise StorageError(f"could not take the lock {path!r}: it was deleted 100 times in a row")

    def release(self) -> None:
        """Delete the lock file, then drop the lock (idempotent)."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("zarrckpt: could not delete the lock file %s: %s", self.path, e)
        os.close(self.fd)
        self.fd = None


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _take_if_dead(path: str) -> tuple[bool, int | None]:
    """(dead, fd holding the lock): a lock file that is absent or that we can lock is dead."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a live save (or no flock here: not known to be dead)
        os.close(fd)
        return False, None
    if not _same_file(fd, path):  # replaced meanwhile: a new save; look again next time
        os.close(fd)
        return False, None
    return True, fd


@dataclass(frozen=True)
class Leftover:
    """What an interrupted save left beside (or at) a checkpoint path on a file system.

    ``kind``: ``"directory"`` (the save's own directory, or data it replaced),
    ``"claim"`` (a pending root at the path itself), ``"lock"`` (its lock file alone).
    ``live``: the save still runs (its lock is held); such leftovers are never removed."""

    path: str
    kind: str
    name: str
    save_id: str
    nbytes: int
    live: bool


def clean_leftovers(directory: str | os.PathLike, *, dry_run: bool = False, name: str | None = None,
                    keep: tuple[str, ...] = (), options: StorageOptions | None = None) -> list[Leftover]:
    """Find, under the local ``directory``, what saves left (hidden directories
    ``.zarrckpt-<id>.<hex of name>``, pending claims, lock files), and remove those of saves
    that are gone: whose lock file is absent or can be locked (spec §7.5). Returns every
    leftover found, live ones included (``live=True``, left alone); with ``dry_run`` nothing
    is removed. ``name``: only leftovers of that checkpoint name; ``keep``: save ids to
    leave alone. On object stores it returns ``[]`` and removes nothing: an interrupted
    save there is a pending root at the path itself, and whether its writer still runs
    cannot be known (no locks); a save with ``overwrite=True`` replaces it."""
    st = open_storage(directory, options)
    parent = st.local_path
    if parent is None:
        return []
    parent = parent.rstrip("/") or "/"
    found = []
    for (nm, sid), items in _scan_leftovers(parent, name).items():
        if sid in keep:
            continue
        lock = next((entry for kind, entry in items if kind == "lock"), fmt.lock_name(nm, sid))
        dead, fd = _take_if_dead(os.path.join(parent, lock))
        try:
            found += [Leftover(os.path.join(parent, entry), kind, nm, sid, _du(os.path.join(parent, entry)),
                               not dead) for kind, entry in items]
            if dead and not dry_run:
                _remove_dead(parent, lock, sid, items)
        finally:
            if fd is not None:
                os.close(fd)
    return found


def _scan_leftovers(parent: str, name: str | None) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(name, save id) -> [(kind, entry)] of the leftovers directly under ``parent``."""
    try:
        entries = sorted(os.listdir(parent))
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise storage_error(f"listing {parent!r}", e) from e
    out: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for entry in entries:
        path = os.path.join(parent, entry)
        found = fmt.parse_leftover_name(entry)
        if found is not None:
            kind, nm, sid = found
            if (name is None or nm == fmt.leftover_name(name)) and (
                    kind == "lock" or (os.path.isdir(path) and not os.path.islink(path))):
                out.setdefault((nm, sid), []).append((kind, entry))
        elif name is None or entry == name:
            sid = _pending_claim(path)
            if sid is not None:
                out.setdefault((entry, sid), []).append(("claim", entry))
    return out


def _pending_claim(path: str) -> str | None:
    """The save id of the pending zarrckpt root in the directory ``path``, if it holds one."""
    if os.path.islink(path) or not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, "zarr.json"), "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        return None
    state, attrs = _classify(open_storage(path), data)
    sid = attrs.get("save_id")
    return sid if state == "pending" and fmt.is_save_id(sid) else None


def _remove_dead(parent: str, lock: str, save_id: str, items: list[tuple[str, str]]) -> None:
    """Remove a dead save's leftovers (its lock file ``lock`` held by us, or gone), the
    lock file last."""
    for kind, entry in items:
        path = os.path.join(parent, entry)
        if kind == "directory":
            _rmtree(path)
        elif kind == "claim":
            with open_storage(path).parent_lock():  # a new save may be claiming it right now
                if _pending_claim(path) == save_id:
                    _rmtree(path)
        log.info("zarrckpt: removed %s, left by save %s that is no longer running", path, save_id)
    try:
        os.unlink(os.path.join(parent, lock))
    except FileNotFoundError:
        pass
    except OSError as e:
        raise storage_error(f"deleting {os.path.join(parent, lock)!r}", e) from e


def _rmtree(path: str) -> None:
    def missing_is_fine(func, p, exc_info):  # another cleaner may be deleting it too
        if not issubclass(exc_info[0], FileNotFoundError):
            raise exc_info[1]

    try:
        shutil.rmtree(path, onerror=missing_is_fine)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise storage_error(f"deleting {path!r}", e) from e


def _du(path: str) -> int:
    """Bytes of the files under ``path`` (0 if it is gone)."""
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            return os.lstat(path).st_size
        return sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(path) for f in files)
    except OSError:
        return 0


def _clean_quietly(location: Storage, save_id: str) -> None:
    """Before a save claims ``location``: remove what dead saves to it left (best effort)."""
    try:
        clean_leftovers(os.path.dirname(location.local_path.rstrip("/")), name=location.name,
                        keep=(save_id,), options=location.options)
    except Exception as e:  # noqa: BLE001 - only space is lost; the save goes on
        log.warning("zarrckpt: could not remove what earlier saves to %s left: %s", location.url, e)

