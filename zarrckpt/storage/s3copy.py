"""Server-side copies of unchanged chunks on S3 (incremental saves, spec §7.9).

An incremental save to S3 whose previous checkpoint is in the same bucket of the same
endpoint stores an unchanged chunk by one ``CopyObject`` request instead of a ``PUT`` of its
bytes: the server copies the object, no chunk byte crosses the node. TensorStore has no copy
(``KvStore.experimental_copy_range_to`` raises ``CopyRange not supported`` on its ``s3``
driver, 0.1.86), so the copies go through `obstore <https://developmentseed.org/obstore/>`_
(the Rust ``object_store`` crate's Python binding, MIT, no dependencies), an optional
dependency: ``pip install "zarrckpt[s3copy]"``. Without it, or where a copy fails (the
source deleted meanwhile, credentials ``obstore`` cannot use, a refused request), the chunk
is written as in a plain save: a save never fails for want of a copy.

The copy is a new, independent object: deleting the previous checkpoint never affects it.
It saves the node's bandwidth and the save's time, not storage (object stores do not share
bytes between objects). Objects over 5 GiB cannot be copied by one request; zarrckpt's chunks
target 256 MiB (Appendix C.1), and a larger one is written.

Credentials are those the save's TensorStore spec uses (``_tensorstore._s3_settings``), and
so is the endpoint (AWS's regional one where the spec names none): anonymous, explicit keys,
environment keys and a profile with static keys are handed over by a credential provider
(never mixed with other ``AWS_*`` variables); the AWS chain (web identity, container and
instance credentials) is left to ``obstore``'s own lookup; a profile that needs
``credential_process``, assume-role or SSO gets no copies.
"""

from __future__ import annotations

import configparser
import datetime
import logging
import os
import threading
from typing import Any

from .content import count as _count
from .content import counters  # chunks_copied, bytes_copied, copy_failures (beside the links')

log = logging.getLogger("zarrckpt")

__all__ = ["Copier", "MAX_COPY_BYTES", "copier", "counters"]

MAX_COPY_BYTES = 5 << 30  # one CopyObject request copies at most 5 GiB

_lock = threading.Lock()
_copiers: dict[tuple, Copier | None] = {}
_warned: set[str] = set()


def _once(why: str) -> None:
    with _lock:
        first = why not in _warned
        _warned.add(why)
    if first:
        log.warning("zarrckpt: unchanged chunks on S3 are written, not copied: %s", why)


class Copier:
    """Server-side copies within one bucket of one S3 endpoint."""

    def __init__(self, store: Any, endpoint: str | None, bucket: str) -> None:
        self._store = store
        self.endpoint = endpoint
        self.bucket = bucket

    def copy(self, src: str, dst: str, nbytes: int, tried: list[int] | None = None) -> bool:
        """Copy object ``src`` to ``dst`` (keys in the bucket); False (counted, logged) where
        it failed: the caller writes the chunk. ``tried`` gets ``nbytes`` appended before the
        request: a copy that timed out here may still complete on the server, so the save
        checks the previous checkpoint after any attempt (``Previous.confirm``)."""
        import obstore

        if nbytes > MAX_COPY_BYTES:
            return False
        if tried is not None:
            tried.append(nbytes)
        try:
            obstore.copy(self._store, src, dst)
        except Exception as e:  # noqa: BLE001 - any failure: write instead
            _count(copy_failures=1)
            log.debug("zarrckpt: copying s3://%s/%s failed (%s); writing it", self.bucket, src, e)
            return False
        _count(chunks_copied=1, bytes_copied=nbytes)
        return True


def copier(spec: dict[str, Any], chain: bool = True) -> Copier | None:
    """The copier of an S3 kvstore spec (bucket, endpoint, region, credentials as
    TensorStore takes them), one per process and spec; None where copies cannot be made
    (not S3, ``obstore`` missing, credentials it cannot use): the chunks are then written.
    ``chain``: credentials of kind ``default`` (the AWS chain) come from a source obstore's
    own chain reads too (not a profile's ``credential_process``, role or SSO)."""
    if spec.get("driver") != "s3":
        return None
    creds = spec.get("aws_credentials") or {}
    key = (spec.get("endpoint"), spec["bucket"], spec.get("aws_region"), repr(sorted(creds.items())))
    with _lock:
        if key in _copiers:
            return _copiers[key]
    made = _make(spec, creds, chain)
    with _lock:
        return _copiers.setdefault(key, made)


def _make(spec: dict[str, Any], creds: dict[str, Any], chain: bool) -> Copier | None:
    """An obstore store that talks to the same endpoint as the same identity as the save's
    TensorStore spec. Its own environment lookups (``AWS_ENDPOINT``, ``AWS_SESSION_TOKEN``,
    ...) must not change either: the endpoint and region are always given, and where the
    spec's credentials are keys they come from a provider, so none is taken from the
    environment."""
    try:
        from obstore.store import S3Store
    except ImportError:
        _once('obstore is not installed (pip install "zarrckpt[s3copy]")')
        return None
    region = spec.get("aws_region") or "us-east-1"
    endpoint = spec.get("endpoint") or f"https://s3.{region}.amazonaws.com"
    config: dict[str, Any] = {"region": region, "endpoint": endpoint}
    keys = None
    kind = creds.get("type")
    if kind == "anonymous":
        config["skip_signature"] = True
    elif kind == "profile":
        profile = creds.get("profile", "default")
        section = {**_section(creds.get("config_file", ""), f"profile {profile}"),
                   **_section(creds.get("config_file", ""), profile),
                   **_section(creds.get("credentials_file", ""), profile)}
        if not section.get("aws_access_key_id"):
            _once(f"profile {profile!r} has no static keys obstore can use")
            return None
        keys = (section["aws_access_key_id"], section.get("aws_secret_access_key", ""),
                section.get("aws_session_token") or None)
    elif kind == "environment":
        keys = (os.environ.get("AWS_ACCESS_KEY_ID", ""), os.environ.get("AWS_SECRET_ACCESS_KEY", ""),
                os.environ.get("AWS_SESSION_TOKEN") or None)
    elif kind == "default":
        # the AWS chain: obstore's own covers web identity, container and instance roles, not
        # what a profile gets through credential_process, assume-role or SSO (``chain``)
        if not chain:
            _once(f"profile {creds.get('profile')!r} gets its credentials in a way obstore cannot "
                  "(credential_process, assume-role or SSO)")
            return None
    else:
        _once(f"credentials of kind {kind!r}")
        return None
    provider = None
    if keys is not None:
        key_id, secret, token = keys

        def provider() -> dict[str, Any]:
            return {"access_key_id": key_id, "secret_access_key": secret, "token": token, "expires_at": None}
    client: dict[str, Any] = {"timeout": datetime.timedelta(minutes=10)}  # a copy of up to 5 GiB is one request
    if endpoint.startswith("http://"):
        client["allow_http"] = True
    try:
        store = S3Store(spec["bucket"], config=config, client_options=client, credential_provider=provider,
                        retry_config={"max_retries": 2, "retry_timeout": datetime.timedelta(seconds=60)})
    except Exception as e:  # noqa: BLE001 - no copies, the save writes
        _once(f"obstore cannot open the bucket ({e})")
        return None
    return Copier(store, endpoint, spec["bucket"])


def _section(path: str, profile: str) -> dict[str, str]:
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read(path)
    except (configparser.Error, OSError):
        return {}
    return dict(cp[profile]) if cp.has_section(profile) else {}
