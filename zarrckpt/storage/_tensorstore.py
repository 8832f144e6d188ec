"""TensorStore-backed implementation of :mod:`zarrckpt.storage`: :class:`TensorStoreStorage`
for every URL zarrckpt takes (file, memory, S3, GCS) and its arrays. The only module that
holds TensorStore handles and kvstore specs (besides ``_localfile``'s chunk files)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import errno as _errno
import functools
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

from ._localfile import (LocalArray, _pool, _pwritev_all, _sub, _unit_crc, chunk_codec, misplaced, unit_crcs,
                         unit_digest, units_codec)
from ._localfile import counters as _direct_counters
from . import content as _content
from . import base as _base
from .base import Array, Box
from ..errors import CheckpointNotFoundError, CorruptChunkError, StorageError, ZarrckptError
from ..format.documents import chunk_key

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
    return _kvstore_spec(url, options)[0]


def _kvstore_spec(url: str | os.PathLike, options: StorageOptions | None) -> tuple[dict[str, Any], _S3Auth | None]:
    """:func:`kvstore_spec`, and for S3 how its requests are signed (for refusals' messages)."""
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
        return {"driver": "file", "path": os.path.abspath(path).rstrip("/") + "/"}, None
    if scheme == "memory":
        return {"driver": "memory", "path": (parsed.netloc + parsed.path).strip("/") + "/"}, None
    if scheme in ("s3", "gs"):
        if not parsed.netloc:
            raise CheckpointNotFoundError(f"{url!r} names no bucket")
        spec: dict[str, Any] = {
            "driver": "s3" if scheme == "s3" else "gcs",
            "bucket": parsed.netloc,
            "path": parsed.path.strip("/") + "/" if parsed.path.strip("/") else "",
        }
        if scheme == "s3":
            settings, auth = _s3_settings(options or StorageOptions())
            spec.update(settings)
            return spec, auth
        return spec, None
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


def _profile_section(path: str, profile: str, config: bool) -> dict[str, str] | None:
    """The settings of ``profile`` in an AWS credentials (``config=False``) or config file
    (section ``[profile NAME]``, or ``[default]``); None where the file or section is absent."""
    import configparser

    if not os.path.isfile(path):
        return None
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read(path)
    except configparser.Error:
        return None
    section = profile if not config or profile == "default" else f"profile {profile}"
    return dict(cp.items(section)) if cp.has_section(section) else None


def _profile_value(path: str, profile: str, key: str, config: bool) -> str | None:
    return (_profile_section(path, profile, config) or {}).get(key)


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


_TRUE = ("1", "true", "yes", "on")
#: Profile settings through which the AWS chain gets credentials other than static keys:
#: assume-role, credential_process (SSO helpers, vaults), SSO, web identity.
_INDIRECT = ("role_arn", "credential_process", "credential_source", "sso_session", "sso_start_url",
             "sso_account_id", "web_identity_token_file")


@dataclass(frozen=True)
class _S3Auth:
    """How a location's requests are signed, for the message of a refusal: ``kind`` is
    ``"anonymous"``, ``"keys"`` (StorageOptions), ``"environment"``, ``"profile"`` or
    ``"chain"`` (TensorStore's ``default`` AWS chain); ``where`` what was used or asked
    for; ``sources`` (chain) what of the chain is configured on this host."""

    kind: str
    where: str
    sources: tuple[str, ...] = ()
    profile: str = "default"
    files: tuple[str, str] = ("", "")

    def refused(self) -> str:
        """What to tell the user when the bucket refuses (HTTP 403) these requests."""
        if self.kind == "anonymous":
            return (f"anonymous requests ({self.where}) were refused: the bucket does not allow "
                    "anonymous access; drop that setting to sign requests with AWS credentials")
        if self.kind != "chain":
            return f"the credentials from {self.where} were refused"
        if self.sources:
            return (f"the credentials the AWS credential chain took from {' or '.join(self.sources)} "
                    "were refused")
        role = _instance_role()
        if role:
            return f"the credentials of this EC2 instance's instance role {role!r} were refused"
        imds = ("disabled by AWS_EC2_METADATA_DISABLED" if _imds_disabled()
                else "unreachable or without an instance role")
        return ("no AWS credentials were found, so the requests were sent unsigned (anonymous) and "
                "refused. Looked in: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                f"profile {self.profile!r} in {self.files[0]} and {self.files[1]} (AWS_PROFILE, "
                "AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE), web identity "
                "(AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN), container credentials "
                f"(AWS_CONTAINER_CREDENTIALS_FULL_URI/RELATIVE_URI), the EC2 instance metadata service ({imds}). "
                "Give credentials (StorageOptions(access_key_id=..., secret_access_key=...), the AWS_* "
                "variables or a profile), or pass StorageOptions(anonymous=True) (AWS_NO_SIGN_REQUEST=true) "
                "for a bucket that allows anonymous access")


def _imds_disabled() -> bool:
    return os.environ.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() in _TRUE


def _instance_role() -> str | None:
    """The instance role the EC2 instance metadata service names (IMDSv2, then v1), or
    None where it is disabled, unreachable or names none. Asked only to explain a refusal
    (two requests, 1 s each at most; once per process and endpoint)."""
    if _imds_disabled():
        return None
    return _instance_role_at(
        (os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or "http://169.254.169.254").rstrip("/"))


@functools.lru_cache(maxsize=None)
def _instance_role_at(base: str) -> str | None:
    import urllib.error
    import urllib.request

    headers = {}
    try:
        req = urllib.request.Request(base + "/latest/api/token", method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        with urllib.request.urlopen(req, timeout=1) as r:
            headers["X-aws-ec2-metadata-token"] = r.read().decode()
    except urllib.error.HTTPError:
        pass  # IMDSv1 only
    except (OSError, ValueError):
        return None
    try:
        req = urllib.request.Request(base + "/latest/meta-data/iam/security-credentials/", headers=headers)
        with urllib.request.urlopen(req, timeout=1) as r:
            roles = r.read().decode().split()
    except (OSError, ValueError):
        return None
    return roles[0] if roles else None


def _s3_credentials(options: StorageOptions) -> tuple[dict[str, Any], _S3Auth]:
    """TensorStore's ``aws_credentials`` for ``options`` and how they were chosen.

    The standard AWS order: anonymous only when asked (``StorageOptions(anonymous=True)``,
    else ``AWS_NO_SIGN_REQUEST``); explicit keys of the call; then the AWS credential chain
    — environment keys, the profile (``profile``, ``AWS_PROFILE`` or ``default``) in the AWS
    files (static keys, assume-role, ``credential_process``), web identity (EKS
    service-account roles), container credentials (ECS task roles, EKS Pod Identity), the
    EC2 instance metadata service (instance roles). A profile that is named but absent, or
    an SSO profile (which TensorStore's chain cannot use), is an error. Where the chain's
    first link decides (environment keys, or a profile with static keys), its TensorStore
    provider is named directly: the same credentials, without the error lines TensorStore's
    ``default`` chain writes to stderr for every link it finds absent."""
    profile, creds_file, config_file = _aws_files(options)
    asked = "StorageOptions(anonymous=True)" if options.anonymous else (
        "AWS_NO_SIGN_REQUEST" if options.anonymous is None
        and os.environ.get("AWS_NO_SIGN_REQUEST", "").strip().lower() in _TRUE else None)
    if asked:
        return {"type": "anonymous"}, _S3Auth("anonymous", asked)
    if options.access_key_id:
        text = (f"[default]\naws_access_key_id = {options.access_key_id}\n"
                f"aws_secret_access_key = {options.secret_access_key or ''}\n"
                + (f"aws_session_token = {options.session_token}\n" if options.session_token else ""))
        tag = (options.access_key_id, options.secret_access_key, options.session_token)
        return ({"type": "profile", "profile": "default", "credentials_file": _private_file(text, tag),
                 "config_file": _private_file("", ("empty",))},
                _S3Auth("keys", "StorageOptions(access_key_id=...)"))
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return {"type": "environment"}, _S3Auth("environment", "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
    in_creds = _profile_section(creds_file, profile, False)
    in_config = _profile_section(config_file, profile, True)
    named = options.profile or os.environ.get("AWS_PROFILE")
    if named and in_creds is None and in_config is None:
        how = "StorageOptions(profile=...)" if options.profile else "AWS_PROFILE"
        raise StorageError(f"AWS profile {profile!r} (from {how}) is in neither {creds_file} nor {config_file} "
                           "(AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE)")
    settings = {**(in_config or {}), **(in_creds or {})}
    where = f"profile {profile!r} ({creds_file if in_creds else config_file})"
    if (any(k.startswith("sso_") for k in settings)
            and not any(k in settings for k in ("aws_access_key_id", "credential_process", "role_arn"))):
        # aws-c-auth's chain in TensorStore 0.1.86 has no SSO provider: say so rather than
        # send anonymous requests
        raise StorageError(
            f"AWS {where} is an SSO (IAM Identity Center) profile, which TensorStore's AWS library cannot "
            f"use directly. Add a profile that gets its credentials through the AWS CLI, e.g. "
            f"[profile {profile}-process] with credential_process = aws configure export-credentials "
            f"--profile {profile} --format process, and use that profile")
    if settings.get("aws_access_key_id") and not any(k in settings for k in _INDIRECT):
        return ({"type": "profile", "profile": profile, "credentials_file": creds_file,
                 "config_file": config_file if os.path.isfile(config_file) else _private_file("", ("empty",))},
                _S3Auth("profile", where))
    sources = []
    if settings.get("aws_access_key_id") or any(k in settings for k in _INDIRECT):
        sources.append(where)
    if os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE") and os.environ.get("AWS_ROLE_ARN"):
        sources.append("web identity (AWS_WEB_IDENTITY_TOKEN_FILE, AWS_ROLE_ARN)")
    for var in ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        if os.environ.get(var):
            sources.append(f"container credentials ({var})")
            break
    # TensorStore's "default" needs the profile named: left out, it looks for a profile
    # called "" and never reads AWS_PROFILE (tensorstore 0.1.86)
    return ({"type": "default", "profile": profile},
            _S3Auth("chain", "the AWS credential chain", tuple(sources), profile, (creds_file, config_file)))


def _s3_settings(options: StorageOptions) -> tuple[dict[str, Any], _S3Auth]:
    """Endpoint, region and credentials of an S3 kvstore, found the usual way: explicit
    ``StorageOptions`` first, then AWS_* environment variables, then the AWS config file
    (profile ``AWS_PROFILE`` or ``default``); credentials as :func:`_s3_credentials` says."""
    profile, _, config_file = _aws_files(options)
    out: dict[str, Any] = {}
    endpoint = (options.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL"))
    if endpoint:
        out["endpoint"] = endpoint
    out["aws_region"] = (options.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                         or _profile_value(config_file, profile, "region", True) or "us-east-1")
    out["aws_credentials"], auth = _s3_credentials(options)
    return out, auth


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
    ``profile`` (AWS_PROFILE; a profile named but absent from the AWS files is an error),
    ``access_key_id``/``secret_access_key``/``session_token`` (explicit keys for this
    call). Without explicit keys, credentials come from the standard AWS credential chain:
    AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY(/AWS_SESSION_TOKEN), the profile in
    ``~/.aws/credentials`` and ``~/.aws/config`` (static keys, ``credential_process``,
    assume-role; an SSO profile is an error: TensorStore's AWS library cannot use it, a
    ``credential_process`` profile calling ``aws configure export-credentials`` can), web
    identity (EKS service-account roles), container credentials (ECS
    task roles, EKS Pod Identity), the EC2 instance metadata service (instance roles; set
    AWS_EC2_METADATA_DISABLED=true where there is none to ask). ``anonymous=True`` sends
    unsigned requests, for public buckets; ``None`` (default) takes it from
    AWS_NO_SIGN_REQUEST (``true``/``yes``/``1``), ``False`` never. Where the chain finds
    nothing, TensorStore sends unsigned requests; a bucket that refuses them fails with a
    :class:`~zarrckpt.errors.StorageError` that says no credentials were found and where
    they were looked for.
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
    anonymous: bool | None = None

    def __post_init__(self) -> None:
        if self.anonymous and (self.access_key_id or self.profile):
            raise ValueError("anonymous=True sends unsigned requests: give it without access_key_id or profile")
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
_DELETE_REQUESTS = 4  # object-store requests of one location's deletions at once (see _deleter)


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


def storage_error(what: str, exc: BaseException, *, hint: str | None = None) -> StorageError:
    """A StorageError for an OSError or a TensorStore status, keeping ``errno``; ``hint``
    (a TensorStore status) goes before the status text."""
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
    err = StorageError(f"{what}: {reason}" + (f"; {hint}" if hint else "") + f" ({exc})")
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




def _put_file(path: str, data: Any, fsync: bool) -> None:
    """Write one small object's file: ``data`` is its bytes or a list of buffers."""
    # created anew, never truncated: a file that exists may be a hard link into another
    # checkpoint (incremental saves, spec §7.9)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, flags, 0o666)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, flags, 0o666)
    try:
        bufs = [b for b in (data if isinstance(data, list) else [data]) if memoryview(b).nbytes]
        if bufs:
            _pwritev_all(fd, bufs, 0)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _put_files(root: str, items: list[tuple], fsync: bool, made: set[str] | None = None) -> None:
    """Write small objects: ``(key, array key, body, crc[, link])``, ``crc`` False (the body
    alone), True (the body and its CRC-32C) or a one-element ``uint32`` array (the same, and
    the CRC-32C is stored there: spec §6.6's table of positions). ``link`` (incremental
    saves, spec §7.9): ``(source path, its unit CRC-32C, list)`` of a previous checkpoint's chunk
    whose content hash equals this one's: hard-linked instead of written when the CRC-32C
    of ``body`` equals it too (the body's size then appended to the list; else, or where the
    link fails, written)."""
    for key, array_key, body, crc, *link in items:
        try:
            if made is not None:  # directories made once per store: no failed open per file
                parent = os.path.dirname(os.path.join(root, key))
                if parent not in made:
                    os.makedirs(parent, exist_ok=True)
                    made.add(parent)
            if crc is not False and crc is not True:
                value = crc32c.crc32c(body)
                crc.reshape(-1)[0] = value
                if link and link[0][1] == value and _content.link(link[0][0], os.path.join(root, key)):
                    if fsync:
                        _content.fsync_path(os.path.join(root, key))
                    _content.count(chunks_linked=1, bytes_linked=memoryview(body).nbytes)
                    link[0][2].append(memoryview(body).nbytes)
                    continue
                bufs = [body, value.to_bytes(4, "little")]
            else:
                bufs = [body, crc32c.crc32c(body).to_bytes(4, "little")] if crc else [body]
            _put_file(os.path.join(root, key), bufs, fsync)
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
    """An open Zarr v3 array through TensorStore's zarr3 driver.

    TensorStore checks every CRC-32C it decodes but hides them. Chunk positions (spec §6.6,
    format 1.3) are therefore checked on the decoded values: with ``positions``, a read
    covers whole units (inner chunks, or chunks: TensorStore decodes whole ones anyway, so
    no more bytes are fetched), computes the CRC-32C of each unit's decoded bytes (padding:
    the fill value) and compares it with the table; a box that does not start and end on
    unit boundaries is read into a buffer of the whole units, then copied. Writes given
    ``crcs`` compute the same CRCs from the host data, beside the write."""

    def __init__(self, store: ts.TensorStore, key: str, metadata: dict[str, Any] | None = None,
                 positions: np.ndarray | None = None, raw: ts.KvStore | None = None) -> None:
        self._ts = store
        self.key = key
        self._units = units_codec(metadata) if metadata is not None else None
        self._positions = positions
        self._raw = raw  # the location's kvstore: the padding entries of edge shards (_edges)
        self._edge_checks: dict[tuple[int, ...], cf.Future] = {}
        self._edge_lock = threading.Lock()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._ts.shape)

    def _region(self, box: Box | None) -> ts.TensorStore:
        return self._ts[tuple(slice(a, b) for a, b in box)] if box else self._ts

    # incremental saves (storage/content.py): the content hash of every whole chunk written is
    # recorded; on S3 an unchanged one is copied server-side (storage/s3copy.py) when the
    # storage gave this array a copier and the chunk's object key (copy_to)
    links_chunks = True
    copier: Any = None
    copy_to: Callable[[tuple[int, ...]], str] | None = None

    def _write(self, box: Box, data: np.ndarray, stable: bool, crcs: np.ndarray | None = None,
               record: Any = None) -> Any:
        if record is not None and self._units is not None:
            return self._write_recorded(box, data, stable, crcs, record)
        write = self._region(box).write(data, can_reference_source_data_indefinitely=stable)
        if crcs is None:
            return write
        u = self._units
        index = tuple(a // c for (a, _), c in zip(box, u.chunk))
        crc = _pool(_CRC_THREADS).submit(lambda: crcs.__setitem__(..., unit_crcs(u, index, data)))
        return _Both(write, crc)

    def _write_recorded(self, box: Box, data: np.ndarray, stable: bool, crcs: np.ndarray | None,
                        record: Any) -> cf.Future:
        """A whole chunk of an incremental or hash-recording save, in a pool task: its content
        hash and unit CRC-32Cs (one pass), recorded; then, where the previous checkpoint's
        chunk has the same of both (spec §7.9 checks 3 and 4; the metadata, checks 1 and 2,
        were compared when ``record.previous`` was made), a server-side copy of it; else,
        or where the copy fails, the TensorStore write of ``data``."""
        u = self._units
        index = tuple(a // c for (a, _), c in zip(box, u.chunk))
        out = _Guarded()

        def task() -> None:
            try:
                digest, unit = unit_digest(u, index, data)
                record.hashes[index] = digest
                if crcs is not None:
                    crcs[...] = unit
                prev = record.previous
                out.copy_or_write(
                    lambda: (prev is not None and self.copier is not None and prev.bucket == self.copier.bucket
                             and prev.matches(index, digest, unit)
                             and self.copier.copy(prev.object_key(index), self.copy_to(index), data.nbytes,
                                                  prev.tried)),
                    lambda: self._region(box).write(data, can_reference_source_data_indefinitely=stable),
                    data.nbytes, record.linked)
            except BaseException as e:  # noqa: BLE001 - handed to the future
                out.end(e)

        _pool(_CRC_THREADS).submit(task)
        return out

    def _edges(self, box: Box | None) -> list[cf.Future]:
        """Spec §5.5 (settled in 1.3): every present entry of a shard index lies inside the
        shard, the entries of inner chunks wholly in the padding too. TensorStore checks the
        entries it decodes; only an edge shard has padding inner chunks, whose entries it never
        looks at. For each edge shard ``box`` touches, once per handle: a check (in a pool
        thread) that reads its index (one ranged read) and, for each present padding entry,
        the last byte its entry and the index would need (a ranged read that fails when the
        entry reaches outside the shard's inner chunks). Writers store no padding inner chunk
        (TensorStore) or store it inside the shard (zarrckpt's direct writer), so a
        conforming checkpoint costs one small read per edge shard read."""
        u = self._units
        if self._raw is None or u is None or not u.sharded or not all(u.shape):
            return []
        box = box or tuple((0, s) for s in u.shape)
        ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(box, u.chunk)]
        out = []
        for k in np.ndindex(*[len(r) for r in ranges]):
            index = tuple(r[i] for r, i in zip(ranges, k))
            if u.present_shape(index) == u.grid:
                continue  # not an edge shard: no padding inner chunk
            with self._edge_lock:
                f = self._edge_checks.get(index)
                if f is None:
                    f = self._edge_checks[index] = _pool(_CRC_THREADS).submit(self._check_edge, index)
            out.append(f)
        return out

    def _check_edge(self, index: tuple[int, ...]) -> None:
        u = self._units
        key = f"{self.key}/{u.chunk_key(index)}"
        where = f"array {self.key!r}: chunk {u.chunk_key(index)}"
        n = u.index_nbytes
        try:
            r = self._raw.read(key, byte_range=slice(-n, None)).result()
        except ValueError:
            return  # absent or shorter than an index: TensorStore's own read reports it
        if r.state != "value":
            return
        raw = bytes(r.value)
        if len(raw) != n or crc32c.crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            return  # a damaged index: TensorStore's own read refuses it
        table = np.frombuffer(raw[:-4], "<u8").reshape(u.count, 2)
        present = u.present_shape(index)
        for k in range(u.count):
            off, nbytes = int(table[k, 0]), int(table[k, 1])
            j = tuple(int(x) for x in np.unravel_index(k, u.grid))
            if all(a < p for a, p in zip(j, present)) or (off == nbytes == 2**64 - 1):
                continue  # a unit TensorStore decodes, or an absent padding unit
            end = off + nbytes + n  # the entry and the index behind it must fit in the shard
            fits = end <= 2**62
            if fits:
                try:
                    self._raw.read(key, byte_range=slice(end - 1, end)).result()
                except ValueError:
                    fits = False
            if not fits:
                raise CorruptChunkError(f"{where} inner chunk {list(j)}: index entry ({off}, {nbytes}) does not fit "
                                        "in the shard: it reaches outside its inner chunks (spec §5.5)")

    def _read_into(self, box: Box, out: np.ndarray) -> Any:
        edges = self._edges(box)
        if edges:
            return _gated(self._read_into_checked(box, out), edges)
        return self._read_into_checked(box, out)

    def _read_into_checked(self, box: Box, out: np.ndarray) -> Any:
        if self._positions is None or not out.size:
            return ts.array(out, copy=False, write=True).write(self._region(box))
        u = self._units
        whole = tuple((a - a % n, min(-(-b // n) * n, s)) for (a, b), n, s in zip(box, u.inner, u.shape))
        into = out if whole == box else _unit_buffer([b - a for a, b in whole], u.dtype)
        read = ts.array(into, copy=False, write=True).write(self._region(whole))
        result: cf.Future = cf.Future()

        def check() -> None:
            try:
                self._check_units(whole, into)
                if into is not out:
                    np.copyto(out, _sub(into, box, tuple(a for a, _ in whole)), casting="no")
            except BaseException as e:  # noqa: BLE001 - handed to the future
                result.set_exception(e)
            else:
                result.set_result(None)

        def read_done(f: Any) -> None:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - handed to the future
                result.set_exception(e)
                return
            _pool(_CRC_THREADS).submit(check)

        read.add_done_callback(read_done)
        return result

    def _check_units(self, whole: Box, data: np.ndarray) -> None:
        """Every unit of ``whole`` (a box of whole units), read into ``data``: the CRC-32C
        of its decoded bytes is the one recorded for its position (spec §6.6)."""
        u = self._units
        origin = tuple(a for a, _ in whole)
        ranges = [range(a // n, -(-b // n)) for (a, b), n in zip(whole, u.inner)]
        for g in np.ndindex(*[len(r) for r in ranges]):
            g = tuple(r[k] for r, k in zip(ranges, g))
            ubox = tuple((k * n, min((k + 1) * n, s)) for k, n, s in zip(g, u.inner, u.shape))
            got = _unit_crc(u, _sub(data, ubox, origin))
            want = int(self._positions[int(np.ravel_multi_index(g, u.unit_grid)) if g else 0])
            if got != want:
                index = tuple(k // p for k, p in zip(g, u.grid))
                where = f"array {self.key!r}: chunk {u.chunk_key(index)}"
                if u.sharded:
                    where += f" inner chunk {[k % p for k, p in zip(g, u.grid)]}"
                raise misplaced(where, got, want)

    def _read(self, box: Box | None) -> ts.Future:
        edges = self._edges(box)
        read = self._region(box).read()
        return _gated(read, edges) if edges else read


_CRC_THREADS = max(os.cpu_count() or 1, 1)  # threads computing chunk CRCs beside TensorStore's I/O


def _gated(main: Any, checks: list[cf.Future]) -> cf.Future:
    """A future of ``main``'s result, done once ``main`` and every check are; the first
    check's error wins over ``main``'s result."""
    out: cf.Future = cf.Future()
    left = [1 + len(checks)]
    lock = threading.Lock()

    def one(_: Any) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            for c in checks:
                c.result()
            out.set_result(main.result())
        except BaseException as e:  # noqa: BLE001 - handed to the future
            out.set_exception(e)

    main.add_done_callback(one)
    for c in checks:
        c.add_done_callback(one)
    return out


class _Guarded(cf.Future):
    """The future of a pool task that reads the caller's data and then copies or writes (an
    incremental save's chunk): an aborted save's ``cancel()`` keeps the task from starting its
    copy or write and cancels a TensorStore write it issued already, but, as :class:`_Both`,
    the future stays pending until the task has ended, so whoever waits for it knows the
    data is no longer read and nothing more lands in the location."""

    def __init__(self) -> None:
        super().__init__()
        self._stopped = False
        self._inner: Any = None
        self._guard = threading.Lock()

    def cancel(self) -> bool:
        with self._guard:
            self._stopped = True
            inner = self._inner
        if inner is not None:
            inner.cancel()
        return False

    def issue(self, start: Callable[[], Any]) -> Any:
        """``start()`` (a TensorStore write), unless cancelled first: then None."""
        with self._guard:
            if self._stopped:
                return None
            self._inner = start()
            return self._inner

    def end(self, error: BaseException | None = None) -> None:
        with contextlib.suppress(cf.InvalidStateError):
            self.set_exception(error) if error is not None else self.set_result(None)

    def copy_or_write(self, copy: Callable[[], bool], write: Callable[[], Any], nbytes: int,
                      linked: list[int]) -> None:
        """In the task: unless cancelled, ``copy()`` (True: copied, ``nbytes`` appended to
        ``linked``, done), else ``write()`` (a future this one then follows)."""
        if self._stopped:
            self.end(_stopped())
            return
        if copy():
            linked.append(nbytes)
            self.end()
            return
        w = self.issue(write)
        if w is None:
            self.end(_stopped())
        else:
            w.add_done_callback(self.end_with)

    def end_with(self, f: Any) -> None:
        """Done as the TensorStore future ``f`` is."""
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - handed to this future
            self.end(e)
        else:
            self.end()


def _stopped() -> StorageError:
    return StorageError("cancelled: the save failed elsewhere before this chunk was written")


class _Both(cf.Future):
    """Done when a TensorStore write and the CRC task beside it are; cancelling it cancels
    the write (an aborted save's writes on object stores)."""

    def __init__(self, write: Any, crc: cf.Future) -> None:
        super().__init__()
        self._write, self._crc, self._left, self._errors = write, crc, 2, []
        self._lock = threading.Lock()
        write.add_done_callback(self._one)
        crc.add_done_callback(self._one)

    def cancel(self) -> bool:
        """Cancel the write (and the CRC task if it has not started), but stay pending until
        both have ended: a CRC task still running reads the source (pinned staging memory a
        later ``release_staging()`` may free), so whoever waits for this future waits for it."""
        self._write.cancel()
        self._crc.cancel()
        return False

    def _one(self, f: Any) -> None:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - handed to this future
            self._errors.append(e)
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last and not self.done():
            try:
                self.set_exception(self._errors[0]) if self._errors else self.set_result(None)
            except cf.InvalidStateError:  # cancelled meanwhile
                pass


class TensorStoreStorage(_base.Storage):
    """A checkpoint directory (or key prefix) on a TensorStore kvstore; local chunk files
    of uncompressed arrays and small objects are written directly (``chunk_io``, ``put``)."""

    def __init__(self, url: str | os.PathLike, options: StorageOptions | None = None, *,
                 spec: dict[str, Any] | None = None) -> None:
        self._url = os.fspath(url)
        self._options = options or StorageOptions()
        self._auth: _S3Auth | None = None
        if spec is None:
            spec, self._auth = _kvstore_spec(url, self._options)
        self._spec = spec
        if self._spec["driver"] in ("s3", "gcs"):
            _before_first_http_request()
        self._context = self._options.context()
        self._kv: ts.KvStore | None = None
        self._del: ts.KvStore | None = None  # see _deleter
        self._pool: cf.ThreadPoolExecutor | None = None
        # directories the small-file writers made (a stale entry costs the old fallback:
        # the open fails and makes the directory)
        self._made: set[str] = set()
        self._copies = False  # enable_copies: an incremental save on S3 copies unchanged chunks

    @property
    def url(self) -> str:
        return self._url

    def _error(self, what: str, exc: BaseException) -> StorageError:
        """:func:`storage_error`; a refusal of S3 requests also says how they were signed
        (and, where no credentials were found, where they were looked for)."""
        hint = None
        if self._auth is not None and status_code(exc) in ("PERMISSION_DENIED", "UNAUTHENTICATED"):
            hint = self._auth.refused()
        return storage_error(what, exc, hint=hint)

    @property
    def options(self) -> StorageOptions:
        return self._options

    @property
    def _kvstore(self) -> ts.KvStore:
        if self._kv is None:
            try:
                self._kv = ts.KvStore.open(self._spec, context=self._context).result()
            except ValueError as e:
                raise self._error(f"cannot open {self.url!r}", e) from e
        return self._kv

    @property
    def _deleter(self) -> ts.KvStore:
        """The kvstore that deletions go through: on object stores its own pool of requests
        (``_DELETE_REQUESTS``, a child of this location's context), so that retention
        deleting a retired step (thousands of DELETEs, slow on a loaded server) never holds
        the request slots a save or load running at the same time needs (issue 28 item 6:
        a save on rank 0 queued behind retention's DELETEs until the other ranks gave up)."""
        if self._spec["driver"] not in ("s3", "gcs"):
            return self._kvstore
        if self._del is None:
            ctx = ts.Context(ts.Context.Spec({"s3_request_concurrency": {"limit": _DELETE_REQUESTS},
                                              "gcs_request_concurrency": {"limit": _DELETE_REQUESTS}}),
                             parent=self._context)
            try:
                self._del = ts.KvStore.open(self._spec, context=ctx).result()
            except ValueError as e:
                raise self._error(f"cannot open {self.url!r}", e) from e
        return self._del

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
            raise self._error(f"reading {self.url}/{key}", e) from e
        return (bytes(r.value) if r.state == "value" else None), bytes(r.stamp.generation)

    def read_if_changed(self, key: str, generation: bytes) -> tuple[bytes | None, bytes] | None:
        try:
            r = self._kvstore.read(key, if_not_equal=generation).result()
        except ValueError as e:
            raise self._error(f"reading {self.url}/{key}", e) from e
        if r.state == "unspecified":  # the same generation
            return None
        return (bytes(r.value) if r.state == "value" else None), bytes(r.stamp.generation)

    def get(self, key: str) -> cf.Future:
        return _then(self._kvstore.read(key), lambda r: bytes(r.value) if r.state == "value" else None,
                     lambda e: self._error(f"reading {self.url}/{key}", e) if isinstance(e, ValueError) else e)

    def write_atomic(self, key: str, data: bytes, *, if_equal: bytes | None = None) -> bool:
        """TensorStore's write-then-rename (file) or conditional PUT (object stores)."""
        try:
            stamp = self._kvstore.write(key, data, if_equal=if_equal or None).result()
        except ValueError as e:
            raise self._error(f"writing {self.url}/{key}", e) from e
        return bool(stamp.generation) or not if_equal

    def object_key(self, key: str) -> str:
        """S3: the key in the bucket of ``key`` under this storage (what a server-side copy
        names: ``storage/s3copy.py``)."""
        return self._spec.get("path", "") + key

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
        return self._pool.submit(_put_files, self.local_path, items, self.options.fsync == "each", self._made)

    def flush(self) -> None:
        """Local files (``fsync="end"``): one syncfs call. Object stores: a completed PUT
        is durable already."""
        path = self.local_path
        if path is None or self.options.fsync != "end":
            return
        try:
            _syncfs(path)
        except OSError as e:
            raise self._error(f"making {self.url!r} durable", e) from e

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
            raise self._error(f"listing {self.url!r}", e) from e

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
            raise self._error(f"listing {self.url!r}", e) from e
        return sorted({k.decode("utf-8", "replace").split("/", 1)[0] for k in keys})

    def list_keys(self) -> list[str]:
        try:
            keys = self._kvstore.list().result()
        except ValueError as e:
            raise self._error(f"listing {self.url!r}", e) from e
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
            futures = [self._deleter.delete_range(ts.KvStore.KeyRange(lo, hi))
                       for lo, hi in zip(bounds[::2], bounds[1::2])]
            for f in futures:
                f.result()
        except (OSError, ValueError) as e:
            raise self._error(f"clearing {self.url!r}", e) from e

    def make_dir(self) -> None:
        path = self.local_path
        if path is not None:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as e:
                raise self._error(f"creating {path!r}", e) from e

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
            raise self._error(f"opening {parent!r}", e) from e
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
            _content.fsync_path(os.path.dirname(to))
        except OSError as e:
            raise self._error(f"moving {src!r} to {to!r}", e) from e
        return old

    def _delete(self, key: str) -> None:
        """Delete one key (absent: nothing to do); ``FaultStorage`` clears key by key."""
        try:
            self._kvstore.write(key, None).result()
        except ValueError as e:
            raise self._error(f"deleting {self.url}/{key}", e) from e

    def remove(self) -> None:
        path = self.local_path
        try:
            if path is not None:
                shutil.rmtree(path, ignore_errors=False) if os.path.isdir(path) else None
                return
            self._deleter.delete_range(ts.KvStore.KeyRange("", "")).result()
        except (OSError, ValueError) as e:
            raise self._error(f"deleting {self.url!r}", e) from e

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

    def _local_array(self, key: str, metadata: dict[str, Any],
                     positions: np.ndarray | None = None) -> LocalArray | None:
        """Direct chunk-file I/O for local arrays zarrckpt can encode itself (``chunk_io``)."""
        path = self.local_path
        if path is None or self.options.chunk_io != "direct":
            return None
        codec = chunk_codec(metadata)
        if codec is None:
            return None
        return LocalArray(os.path.join(path, key.rstrip("/")), codec, key,
                          threads=self.options.file_io_concurrency, fsync=self.options.fsync == "each",
                          positions=positions)

    def open_for_write(self, key: str, metadata: dict[str, Any]) -> Any:
        """:class:`TensorStoreArray`, or :class:`LocalArray` (``chunk_io="direct"``)."""
        local = self._local_array(key, metadata)
        if local is not None:
            return _done(local)
        opened = _Opened(ts.open(self._array_spec(key, metadata), open=True, assume_metadata=True,
                                 context=self._context), key, metadata)
        copier = self.copier if self._copies else None
        if copier is not None:  # incremental saves to S3: unchanged chunks copied server-side
            sep = metadata.get("chunk_key_encoding", {}).get("configuration", {}).get("separator", "/")
            base = self._spec.get("path", "") + key.strip("/") + "/"
            opened.copy = (copier, lambda index: base + sep.join(["c", *map(str, index)]))
        return opened

    def copy_or_write_plain_chunk(self, array_key: str, index: tuple[int, ...], data: np.ndarray, crc: int,
                                  source: str, bucket: str, linked: list[int], tried: list[int]) -> cf.Future:
        copier = self.copier
        if copier is None or copier.bucket != bucket:
            return self.write_plain_chunk(array_key, index, data, crc)
        dst = self._spec.get("path", "") + f"{array_key.strip('/')}/{chunk_key(index)}"
        out = _Guarded()

        def task() -> None:
            try:
                out.copy_or_write(lambda: copier.copy(source, dst, data.nbytes, tried),
                                  lambda: self.write_plain_chunk(array_key, index, data, crc), data.nbytes, linked)
            except BaseException as e:  # noqa: BLE001 - handed to the future
                out.end(e)

        _pool(_CRC_THREADS).submit(task)
        return out

    @property
    def copier(self) -> Any:
        """S3: this bucket's server-side copier (``storage/s3copy.py``), made on first use;
        None elsewhere or where copies cannot be made."""
        if self._spec.get("driver") != "s3":
            return None
        from . import s3copy

        creds, chain = self._spec.get("aws_credentials") or {}, True
        if creds.get("type") == "default":  # the AWS chain: not through a profile obstore cannot use
            profile = creds.get("profile") or "default"
            _, creds_file, config_file = _aws_files(self._options)
            found = {**(_profile_section(config_file, profile, True) or {}),
                     **(_profile_section(creds_file, profile, False) or {})}
            chain = not any(k in found for k in _INDIRECT)
        return s3copy.copier(self._spec, chain)

    def enable_copies(self) -> Any:
        """An incremental save from a checkpoint in this bucket: its arrays opened for writing
        from now on copy unchanged chunks (:meth:`open_for_write`); the copier, or None (then
        nothing is copied)."""
        copier = self.copier
        self._copies = copier is not None
        return copier

    def open_for_read(self, key: str, metadata: dict[str, Any], positions: np.ndarray | None = None) -> Any:
        local = self._local_array(key, metadata, positions)
        if local is not None:
            return _done(local)
        return _Opened(self.open_tensorstore(key, metadata), key, metadata, positions, self._kvstore)

    def open_tensorstore(self, key: str, metadata: dict[str, Any]) -> ts.Future:
        """A future of the TensorStore handle of an array (lazy views: slicing, ``.read()``).
        Not part of :class:`Storage`: its readers are being moved onto one read primitive."""
        return ts.open(self._array_spec(key, metadata), open=True, read=True, assume_metadata=True,
                       context=self._context)


# The old name of TensorStoreStorage here, for tests that patch its methods


class _Opened:
    """``.result()`` of an array open: the TensorStore future's handle wrapped in
    :class:`TensorStoreArray`."""

    def __init__(self, future: Any, key: str, metadata: dict[str, Any] | None = None,
                 positions: np.ndarray | None = None, raw: ts.KvStore | None = None) -> None:
        self._f, self._key, self._metadata, self._positions, self._raw = future, key, metadata, positions, raw
        self.copy: tuple[Any, Callable] | None = None  # (copier, chunk index -> object key): S3 writes

    def result(self, timeout: float | None = None) -> Array:
        array = TensorStoreArray(self._f.result(timeout=timeout), self._key, self._metadata, self._positions,
                                 self._raw)
        if self.copy is not None:
            array.copier, array.copy_to = self.copy
        return array


def _unit_buffer(shape: list[int], dtype: np.dtype) -> np.ndarray:
    """The buffer of whole units a checked read of an unaligned box goes through (callers
    count its bytes in flight: ``unit_elements``)."""
    return np.empty(shape, dtype)


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
