"""TensorStore-backed implementation of :mod:`zarrckpt.storage`: :class:`TensorStoreStorage`
for every URL zarrckpt takes (file, memory, S3, GCS) and its arrays. The only module that
holds TensorStore handles and kvstore specs (besides ``_localfile``'s chunk files)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import errno as _errno
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import crc32c
import numpy as np
import tensorstore as ts

from ._localfile import LocalArray, _pwritev_all, chunk_codec
from ._localfile import counters as _direct_counters
from . import base as _base
from .base import Array, Box
from ..errors import CheckpointNotFoundError, CorruptChunkError, StorageError, ZarrckptError

__all__ = ["StorageOptions", "TensorStoreArray", "TensorStoreStorage", "in_memory_array", "io_counters",
           "kvstore_spec", "status_code", "storage_error", "translate_error"]


def _before_first_http_request() -> None:
    """curl's only timeout: a transfer slower than 256 B/s for this long fails (and is
    retried); TensorStore's default is 60 s. There is no kvstore spec or context option for
    it (TensorStore 0.1.86): its curl transport reads the environment variable once, at the
    first HTTP request of the process. So it is set here, when an S3 or GCS location is
    first opened (before any request of it), not at import: a process that never opens an
    object store keeps its environment, and a value the user set is kept."""
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "20")


def kvstore_spec(url: str | os.PathLike, options: StorageOptions | None = None) -> dict[str, Any]:
    """TensorStore kvstore spec (a directory, trailing ``/``) for a checkpoint URL."""
    url = os.fspath(url)
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        path = parsed.path if scheme == "file" else url
        if not path:
            raise CheckpointNotFoundError(f"empty checkpoint path {url!r}")
        path = os.path.expanduser(path)
        if os.path.lexists(path):  # write through a symlink, not over it
            path = os.path.realpath(path)
        return {"driver": "file", "path": os.path.abspath(path).rstrip("/") + "/"}
    if scheme == "memory":
        return {"driver": "memory", "path": (parsed.netloc + parsed.path).strip("/") + "/"}
    if scheme in ("s3", "gs"):
        if not parsed.netloc:
            raise CheckpointNotFoundError(f"{url!r} names no bucket")
        spec: dict[str, Any] = {
            "driver": "s3" if scheme == "s3" else "gcs",
            "bucket": parsed.netloc,
            "path": parsed.path.strip("/") + "/" if parsed.path.strip("/") else "",
        }
        if scheme == "s3":
            spec.update(_s3_settings(options or StorageOptions()))
        return spec
    raise CheckpointNotFoundError(
        f"unsupported checkpoint URL scheme {scheme!r} in {url!r}; use a path, file://, "
        "memory://, s3:// or gs://"
    )


def _aws_files(options: StorageOptions) -> tuple[str, str, str]:
    """(profile, credentials file, config file) as the AWS CLI finds them."""
    profile = options.profile or os.environ.get("AWS_PROFILE") or "default"
    creds = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    config = os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    return profile, creds, config


def _profile_value(path: str, profile: str, key: str, config: bool) -> str | None:
    import configparser

    if not os.path.isfile(path):
        return None
    cp = configparser.ConfigParser()
    try:
        cp.read(path)
    except configparser.Error:
        return None
    section = profile if not config or profile == "default" else f"profile {profile}"
    return cp.get(section, key, fallback=None)


_secret_files: dict[tuple, str] = {}


def _private_file(text: str, tag: tuple) -> str:
    """A file only this user can read, kept for the process's life (TensorStore reads
    credentials from files only)."""
    path = _secret_files.get(tag)
    if path is None:
        import tempfile

        fd, path = tempfile.mkstemp(prefix="zarrckpt-aws-", text=True)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, 0o600)
        import atexit

        atexit.register(lambda p=path: os.path.exists(p) and os.remove(p))
        _secret_files[tag] = path
    return path


def _s3_settings(options: StorageOptions) -> dict[str, Any]:
    """Endpoint, region and credentials of an S3 kvstore, found the usual way: explicit
    ``StorageOptions`` first, then AWS_* environment variables, then the AWS config and
    credentials files (profile ``AWS_PROFILE`` or ``default``), else anonymous. Never
    TensorStore's "default" provider chain, which prints errors when the files are absent."""
    profile, creds_file, config_file = _aws_files(options)
    out: dict[str, Any] = {}
    endpoint = (options.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL"))
    if endpoint:
        out["endpoint"] = endpoint
    out["aws_region"] = (options.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                         or _profile_value(config_file, profile, "region", True) or "us-east-1")
    if options.access_key_id:
        text = (f"[default]\naws_access_key_id = {options.access_key_id}\n"
                f"aws_secret_access_key = {options.secret_access_key or ''}\n"
                + (f"aws_session_token = {options.session_token}\n" if options.session_token else ""))
        tag = (options.access_key_id, options.secret_access_key, options.session_token)
        out["aws_credentials"] = {"type": "profile", "profile": "default",
                                  "credentials_file": _private_file(text, tag),
                                  "config_file": _private_file("", ("empty",))}
    elif os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        out["aws_credentials"] = {"type": "environment"}
    elif (_profile_value(creds_file, profile, "aws_access_key_id", False)
          or _profile_value(config_file, profile, "aws_access_key_id", True)):
        out["aws_credentials"] = {
            "type": "profile", "profile": profile, "credentials_file": creds_file,
            "config_file": config_file if os.path.isfile(config_file) else _private_file("", ("empty",))}
    else:
        out["aws_credentials"] = {"type": "anonymous"}
    return out


@dataclass(frozen=True)
class StorageOptions:
    """TensorStore settings (spec-neutral; chosen from benchmarks, overridable).

    ``file_io_concurrency``: parallel file operations per process.
    ``data_copy_concurrency``: threads encoding/decoding chunks (crc32c, zstd).
    ``fsync``: how local files are made durable before the commit relies on them:
    ``"end"`` (default) one ``syncfs`` of the file system per rank after all its writes,
    ``"each"`` an fsync per file as it is written, ``"off"`` none (scratch space).
    ``chunk_io``: on local file systems, ``"direct"`` (default) writes and reads the chunk
    files of uncompressed arrays itself, in ``file_io_concurrency`` threads, straight from
    and into tensor memory (``storage/_localfile.py``: the same bytes TensorStore writes,
    with one pass over the data instead of an encoded copy per shard);
    ``"tensorstore"`` sends every chunk through TensorStore's zarr3 driver.
    ``request_retries``: object stores (S3, GCS) retry a failed request this many times,
    with exponential backoff from 0.25 s to 8 s, then the operation fails (TensorStore's
    default retries for 15 minutes, so an unreachable endpoint would stall a save).
    S3 (each falls back to the usual AWS_* variable, then the AWS config files):
    ``endpoint`` (S3-compatible servers; AWS_ENDPOINT_URL), ``region`` (AWS_REGION),
    ``profile`` (AWS_PROFILE), ``access_key_id``/``secret_access_key``/``session_token``
    (explicit keys for this call; AWS_ACCESS_KEY_ID ...). Without any credentials the
    bucket is accessed anonymously.
    """

    file_io_concurrency: int = 32
    data_copy_concurrency: int = field(default_factory=lambda: max(os.cpu_count() or 1, 1))
    fsync: str = "end"
    chunk_io: str = "direct"
    request_retries: int = 6
    endpoint: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.fsync not in ("end", "each", "off"):
            raise ValueError(f"fsync must be 'end', 'each' or 'off', not {self.fsync!r}")
        if self.chunk_io not in ("direct", "tensorstore"):
            raise ValueError(f"chunk_io must be 'direct' or 'tensorstore', not {self.chunk_io!r}")
        if self.request_retries < 0:
            raise ValueError(f"request_retries must be >= 0, not {self.request_retries!r}")

    def context(self) -> ts.Context:
        """The TensorStore context for these options: one per process and options value,
        all children of one root context, so ``memory://`` data outlives a call."""
        with _contexts_lock:
            ctx = _contexts.get(self)
            if ctx is None:
                retries = {"max_retries": self.request_retries, "initial_delay": "0.25s",
                           "max_delay": "8s"}
                spec = {
                    "file_io_concurrency": {"limit": self.file_io_concurrency},
                    "data_copy_concurrency": {"limit": self.data_copy_concurrency},
                    "file_io_sync": self.fsync == "each",
                    "cache_pool": {"total_bytes_limit": 0},
                    "s3_request_retries": retries,
                    "gcs_request_retries": retries,
                }
                ctx = _contexts[self] = ts.Context(ts.Context.Spec(spec), parent=_root_context())
            return ctx


_contexts: dict[StorageOptions, ts.Context] = {}
_contexts_lock = threading.Lock()
_ROOT: list[ts.Context] = []


def _root_context() -> ts.Context:
    if not _ROOT:
        _ROOT.append(ts.Context())
    return _ROOT[0]


# ------------------------------------------------------------------------ errors

_STATUS = re.compile(r"^([A-Z_]+): ")
_UNREACHABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED")


def status_code(exc: BaseException) -> str | None:
    """TensorStore's absl status code (``"DATA_LOSS"`` ...), which leads its messages."""
    m = _STATUS.match(str(exc))
    return m.group(1) if m else None


def storage_error(what: str, exc: BaseException) -> StorageError:
    """A StorageError for an OSError or a TensorStore status, keeping ``errno``."""
    if isinstance(exc, OSError):
        reason = {
            _errno.ENOSPC: "no space left on the device",
            _errno.EDQUOT: "disk quota exceeded",
            _errno.EROFS: "read-only file system",
            _errno.EACCES: "permission denied",
            _errno.EPERM: "operation not permitted",
        }.get(exc.errno, exc.strerror or str(exc))
        err = StorageError(f"{what}: {reason}" + (f" ({exc.filename})" if exc.filename else ""))
        err.errno, err.strerror, err.filename = exc.errno, exc.strerror, exc.filename
        return err
    code = status_code(exc)
    reason = {
        "RESOURCE_EXHAUSTED": "storage is full or a quota is exhausted",
        "PERMISSION_DENIED": "permission denied",
        "UNAUTHENTICATED": "credentials refused",
        "NOT_FOUND": "not found (a missing bucket or directory?)",
    }.get(code or "", "storage unreachable or failing" if code in _UNREACHABLE else "storage error")
    err = StorageError(f"{what}: {reason} ({exc})")
    if code == "RESOURCE_EXHAUSTED":
        err.errno = _errno.ENOSPC
    return err


def translate_error(exc: BaseException, key: str, op: str = "read") -> BaseException:
    """Map an error of a storage operation on array ``key`` to a zarrckpt error that names
    it, by TensorStore's status code (``op``: ``"read"`` or ``"write"``)."""
    if isinstance(exc, ZarrckptError):
        return exc
    if isinstance(exc, OSError):
        return storage_error(f"array {key!r}: {op} failed", exc)
    code = status_code(exc)
    if op == "read":
        if code == "DATA_LOSS":
            return CorruptChunkError(f"array {key!r}: a chunk fails its checksum or is damaged ({exc})")
        if code == "NOT_FOUND":
            return CorruptChunkError(f"array {key!r}: a chunk is missing from storage ({exc})")
        if code in ("FAILED_PRECONDITION", "INVALID_ARGUMENT", "OUT_OF_RANGE"):
            return CorruptChunkError(f"array {key!r}: a chunk cannot be decoded ({exc})")
    if code is None and not isinstance(exc, (ValueError, TimeoutError)):
        return exc  # not a storage error (e.g. a bug): keep it as it is
    return storage_error(f"array {key!r}: {op} failed", exc)


# ------------------------------------------------------------------------ local files


def _syncfs(path: str) -> None:
    """Flush the file system holding ``path`` (Linux syncfs; os.sync elsewhere)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if hasattr(libc, "syncfs"):
            if libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs failed: {os.strerror(err)}", path)
        else:  # pragma: no cover - non-Linux
            os.sync()
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_file(path: str, data: Any, fsync: bool) -> None:
    """Write one small object's file: ``data`` is its bytes or a list of buffers."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, flags, 0o666)
    try:
        bufs = [b for b in (data if isinstance(data, list) else [data]) if memoryview(b).nbytes]
        if bufs:
            _pwritev_all(fd, bufs, 0)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _put_files(root: str, items: list[tuple[str, str, Any, bool]], fsync: bool) -> None:
    for key, array_key, body, crc in items:
        try:
            _put_file(os.path.join(root, key),
                      [body, crc32c.crc32c(body).to_bytes(4, "little")] if crc else [body], fsync)
        except OSError as e:
            e.zarrckpt_key = array_key  # inflight.wait_all names this array
            raise


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (_errno.EINVAL, _errno.ENOSYS, _errno.ENOTSUP):
        return False  # file system or kernel without RENAME_EXCHANGE (NFS, old kernels)
    raise OSError(err, os.strerror(err), a)


def in_memory_array(data: np.ndarray) -> ts.TensorStore:
    """A read-only TensorStore array over a copy of ``data`` (packed leaves' handles)."""
    return ts.array(np.ascontiguousarray(data), write=False)


class TensorStoreArray(Array):
    """An open Zarr v3 array through TensorStore's zarr3 driver."""

    def __init__(self, store: ts.TensorStore, key: str) -> None:
        self._ts = store
        self.key = key

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._ts.shape)

    def _region(self, box: Box | None) -> ts.TensorStore:
        return self._ts[tuple(slice(a, b) for a, b in box)] if box else self._ts

    def _write(self, box: Box, data: np.ndarray, stable: bool) -> ts.Future:
        return self._region(box).write(data, can_reference_source_data_indefinitely=stable)

    def _read_into(self, box: Box, out: np.ndarray) -> ts.Future:
        return ts.array(out, copy=False, write=True).write(self._region(box))

    def _read(self, box: Box | None) -> ts.Future:
        return self._region(box).read()


class TensorStoreStorage(_base.Storage):
    """A checkpoint directory (or key prefix) on a TensorStore kvstore; local chunk files
    of uncompressed arrays and small objects are written directly (``chunk_io``, ``put``)."""

    def __init__(self, url: str | os.PathLike, options: StorageOptions | None = None, *,
                 spec: dict[str, Any] | None = None) -> None:
        self._url = os.fspath(url)
        self._options = options or StorageOptions()
        self._spec = spec if spec is not None else kvstore_spec(url, self._options)
        if self._spec["driver"] in ("s3", "gcs"):
            _before_first_http_request()
        self._context = self._options.context()
        self._kv: ts.KvStore | None = None
        self._pool: cf.ThreadPoolExecutor | None = None

    @property
    def url(self) -> str:
        return self._url

    @property
    def options(self) -> StorageOptions:
        return self._options

    @property
    def _kvstore(self) -> ts.KvStore:
        if self._kv is None:
            try:
                self._kv = ts.KvStore.open(self._spec, context=self._context).result()
            except ValueError as e:
                raise storage_error(f"cannot open {self.url!r}", e) from e
        return self._kv

    def identity(self) -> dict[str, Any]:
        """The kvstore spec without credentials and region (how each rank reaches it)."""
        return {k: v for k, v in self._spec.items() if k not in ("aws_credentials", "aws_region")}

    @property
    def local_path(self) -> str | None:
        return self._spec["path"] if self._spec["driver"] == "file" else None

    @property
    def is_object_store(self) -> bool:
        """S3 or GCS: a failing request is retried (``request_retries``) before it fails."""
        return self._spec["driver"] in ("s3", "gcs")

    @property
    def can_rename(self) -> bool:
        """Whole checkpoints can be moved into place atomically (local file systems)."""
        return self.local_path is not None

    def close(self) -> None:
        """Wait for and release the plain-file writer threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- documents ----------------------------------------------------------

    def read_bytes(self, key: str) -> tuple[bytes | None, bytes]:
        try:
            r = self._kvstore.read(key).result()
        except ValueError as e:
            raise storage_error(f"reading {self.url}/{key}", e) from e
        return (bytes(r.value) if r.state == "value" else None), bytes(r.stamp.generation)

    def read_if_changed(self, key: str, generation: bytes) -> tuple[bytes | None, bytes] | None:
        try:
            r = self._kvstore.read(key, if_not_equal=generation).result()
        except ValueError as e:
            raise storage_error(f"reading {self.url}/{key}", e) from e
        if r.state == "unspecified":  # the same generation
            return None
        return (bytes(r.value) if r.state == "value" else None), bytes(r.stamp.generation)

    def get(self, key: str) -> cf.Future:
        return _then(self._kvstore.read(key), lambda r: bytes(r.value) if r.state == "value" else None,
                     lambda e: storage_error(f"reading {self.url}/{key}", e) if isinstance(e, ValueError) else e)

    def write_atomic(self, key: str, data: bytes, *, if_equal: bytes | None = None) -> bool:
        """TensorStore's write-then-rename (file) or conditional PUT (object stores)."""
        try:
            stamp = self._kvstore.write(key, data, if_equal=if_equal or None).result()
        except ValueError as e:
            raise storage_error(f"writing {self.url}/{key}", e) from e
        return bool(stamp.generation) or not if_equal

    def put(self, key: str, data: bytes) -> Any:
        """On a local file system this is a plain file write from a small thread pool:
        TensorStore's file kvstore spends ~0.5 ms per object (temp file + rename), 5-7x more
        than the write itself, which dominates checkpoints of thousands of small tensors."""
        path = self.local_path
        if path is None:
            return self._kvstore.write(key, data)
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(4, thread_name_prefix="zarrckpt-put")
        return self._pool.submit(_put_file, os.path.join(path, key), data, self.options.fsync == "each")

    @property
    def puts_files(self) -> bool:
        """:meth:`put_files` is available (a local file system)."""
        return self.local_path is not None

    def put_files(self, items: list[tuple[str, str, Any, bool]]) -> cf.Future:
        """Local file systems: write several small objects in one task of the writer pool,
        so a save of thousands of small arrays makes one future and a few GIL hand-offs
        per batch rather than per object (see ``engine.save.ChunkWriter``). ``items``:
        (key, array key, body, crc): ``crc`` appends the body's CRC-32C (spec §5.5), computed
        in the writer thread. A failure names the array key of the object that failed."""
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(4, thread_name_prefix="zarrckpt-put")
        return self._pool.submit(_put_files, self.local_path, items, self.options.fsync == "each")

    def flush(self) -> None:
        """Local files (``fsync="end"``): one syncfs call. Object stores: a completed PUT
        is durable already."""
        path = self.local_path
        if path is None or self.options.fsync != "end":
            return
        try:
            _syncfs(path)
        except OSError as e:
            raise storage_error(f"making {self.url!r} durable", e) from e

    # ---- listing ------------------------------------------------------------------

    def is_empty(self) -> bool:
        path = self.local_path
        try:
            if path is not None:
                if os.path.lexists(path.rstrip("/")) and not os.path.isdir(path):
                    return False  # a file, a FIFO ...: not ours
                return not os.path.exists(path) or not os.listdir(path)
            return not self._kvstore.list(ts.KvStore.KeyRange("", "")).result()
        except (OSError, ValueError) as e:
            raise storage_error(f"listing {self.url!r}", e) from e

    def exists(self) -> bool:
        path = self.local_path
        return os.path.lexists(path.rstrip("/")) if path is not None else not self.is_empty()

    def list_children(self) -> list[str]:
        """(Object stores list every key below the prefix to find them: cost grows with
        the number of keys.)"""
        path = self.local_path
        try:
            if path is not None:
                return sorted(os.listdir(path)) if os.path.isdir(path) else []
            keys = self._kvstore.list().result()
        except (OSError, ValueError) as e:
            raise storage_error(f"listing {self.url!r}", e) from e
        return sorted({k.decode("utf-8", "replace").split("/", 1)[0] for k in keys})

    def list_keys(self) -> list[str]:
        try:
            keys = self._kvstore.list().result()
        except ValueError as e:
            raise storage_error(f"listing {self.url!r}", e) from e
        return sorted(k.decode("utf-8", "replace") for k in keys)

    # ---- the location as a whole ------------------------------------------------

    def clear(self, keep: tuple[str, ...] = ()) -> None:
        path = self.local_path
        try:
            if path is not None:
                if os.path.isdir(path):
                    for name in os.listdir(path):
                        if name in keep:
                            continue
                        p = os.path.join(path, name)
                        shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
                return
            bounds = ["", *[b for k in sorted(keep) for b in (k, k + "\0")], ""]
            futures = [self._kvstore.delete_range(ts.KvStore.KeyRange(lo, hi))
                       for lo, hi in zip(bounds[::2], bounds[1::2])]
            for f in futures:
                f.result()
        except (OSError, ValueError) as e:
            raise storage_error(f"clearing {self.url!r}", e) from e

    def make_dir(self) -> None:
        path = self.local_path
        if path is not None:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as e:
                raise storage_error(f"creating {path!r}", e) from e

    def child(self, name: str) -> TensorStoreStorage:
        return TensorStoreStorage(f"{self.url.rstrip('/')}/{name}", self.options)

    def sibling(self, name: str) -> TensorStoreStorage:
        path = self.local_path
        if path is None:
            return super().sibling(name)
        parent = os.path.dirname(path.rstrip("/"))
        return TensorStoreStorage(os.path.join(parent, name), self.options)

    @property
    def name(self) -> str:
        path = self.local_path
        return os.path.basename(path.rstrip("/")) if path is not None else super().name

    @contextlib.contextmanager
    def parent_lock(self) -> Iterator[None]:
        """An exclusive ``flock`` on the parent directory. Where the file system refuses
        locks on directories, no lock is taken."""
        path = self.local_path
        if path is None:
            yield
            return
        import fcntl

        parent = os.path.dirname(path.rstrip("/"))
        try:
            os.makedirs(parent, exist_ok=True)
            fd = os.open(parent, os.O_RDONLY)
        except OSError as e:
            raise storage_error(f"opening {parent!r}", e) from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                pass  # e.g. some network file systems: go on without it
            yield
        finally:
            os.close(fd)

    def move_to(self, dst: _base.Storage) -> _base.Storage | None:
        """If ``dst`` holds something, it is swapped out (RENAME_EXCHANGE) and returned as
        a location at this directory's old path; where exchange is unsupported, the old
        ``dst`` is first renamed aside (a short window in which ``dst`` does not exist)."""
        if self.local_path is None or dst.local_path is None:
            return super().move_to(dst)
        src, to = self.local_path.rstrip("/"), dst.local_path.rstrip("/")
        try:
            if not os.path.lexists(to):
                os.rename(src, to)
                old = None
            elif _exchange(src, to):
                old = self
            else:
                aside = src + "-old"  # named after this save, so cleaners know whose it is
                os.rename(to, aside)
                os.rename(src, to)
                old = TensorStoreStorage(aside, self.options)
            _fsync_dir(os.path.dirname(to))
        except OSError as e:
            raise storage_error(f"moving {src!r} to {to!r}", e) from e
        return old

    def _delete(self, key: str) -> None:
        """Delete one key (absent: nothing to do); ``FaultStorage`` clears key by key."""
        try:
            self._kvstore.write(key, None).result()
        except ValueError as e:
            raise storage_error(f"deleting {self.url}/{key}", e) from e

    def remove(self) -> None:
        path = self.local_path
        try:
            if path is not None:
                shutil.rmtree(path, ignore_errors=False) if os.path.isdir(path) else None
                return
            self._kvstore.delete_range(ts.KvStore.KeyRange("", "")).result()
        except (OSError, ValueError) as e:
            raise storage_error(f"deleting {self.url!r}", e) from e

    # ---- arrays -------------------------------------------------------------

    def _array_spec(self, key: str, metadata: dict[str, Any] | None) -> dict[str, Any]:
        kv = dict(self._spec, path=self._spec["path"] + key.rstrip("/") + "/")
        spec: dict[str, Any] = {
            "driver": "zarr3",
            "kvstore": kv,
            "recheck_cached_data": False,  # checkpoints are immutable
            "recheck_cached_metadata": False,
            "fill_missing_data_reads": False,  # a missing chunk is damage, not zeros
            "store_data_equal_to_fill_value": True,  # so every chunk exists
        }
        if metadata is not None:
            spec["metadata"] = metadata
        return spec

    def _local_array(self, key: str, metadata: dict[str, Any]) -> LocalArray | None:
        """Direct chunk-file I/O for local arrays zarrckpt can encode itself (``chunk_io``)."""
        path = self.local_path
        if path is None or self.options.chunk_io != "direct":
            return None
        codec = chunk_codec(metadata)
        if codec is None:
            return None
        return LocalArray(os.path.join(path, key.rstrip("/")), codec, key,
                          threads=self.options.file_io_concurrency, fsync=self.options.fsync == "each")

    def open_for_write(self, key: str, metadata: dict[str, Any]) -> Any:
        """:class:`TensorStoreArray`, or :class:`LocalArray` (``chunk_io="direct"``)."""
        local = self._local_array(key, metadata)
        if local is not None:
            return _done(local)
        return _Opened(ts.open(self._array_spec(key, metadata), open=True, assume_metadata=True,
                               context=self._context), key)

    def open_for_read(self, key: str, metadata: dict[str, Any]) -> Any:
        local = self._local_array(key, metadata)
        if local is not None:
            return _done(local)
        return _Opened(self.open_tensorstore(key, metadata), key)

    def open_tensorstore(self, key: str, metadata: dict[str, Any]) -> ts.Future:
        """A future of the TensorStore handle of an array (lazy views: slicing, ``.read()``).
        Not part of :class:`Storage`: its readers are being moved onto one read primitive."""
        return ts.open(self._array_spec(key, metadata), open=True, read=True, assume_metadata=True,
                       context=self._context)


# The old name of TensorStoreStorage here, for tests that patch its methods


class _Opened:
    """``.result()`` of an array open: the TensorStore future's handle wrapped in
    :class:`TensorStoreArray`."""

    def __init__(self, future: Any, key: str) -> None:
        self._f, self._key = future, key

    def result(self, timeout: float | None = None) -> Array:
        return TensorStoreArray(self._f.result(timeout=timeout), self._key)


def _done(value: Any) -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_result(value)
    return f


def _then(future: Any, value: Callable[[Any], Any], error: Callable[[BaseException], BaseException]) -> cf.Future:
    """A future of ``value(future.result())``, failing with ``error(e)`` where it fails."""
    out: cf.Future = cf.Future()

    def done(f: Any) -> None:
        try:
            result = f.result()
        except BaseException as e:  # noqa: BLE001 - handed to the future
            out.set_exception(error(e))
            return
        out.set_result(value(result))
    future.add_done_callback(done)
    return out


def io_counters() -> dict[str, int]:
    """Bytes this process has read from and written to storage so far, through TensorStore's
    kvstores (its metrics) and the direct chunk-file path together."""
    out = dict(_direct_counters())
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        name = m["name"].rsplit("/", 1)[-1]
        if name in out:  # bytes_read, bytes_written
            out[name] += sum(int(v.get("value", 0)) for v in m["values"])
    return out
