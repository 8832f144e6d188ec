"""The CheckpointManager on a real S3 server whose answers for one step's root fail (issue 18,
item 16): a root that cannot be read (HTTP 503 after TensorStore's retries) makes
``latest_step``/``steps``/``restore`` raise a StorageError naming the step, never fall back to
an older step; a root that is absent or pending is skipped silently (spec Appendix C.7).

Between the manager and SeaweedFS sits a small HTTP proxy in the test process: it forwards
every request unchanged (the Host header too, so the SigV4 signatures still hold) except GETs
of the keys it is told to fail, which it answers with 503."""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import time
import urllib.parse

import pytest
import torch

import zarrckpt
from _s3 import S3Server

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "te", "upgrade",
               "proxy-connection", "content-length"}


class FailingProxy:
    """Forwards every request to ``upstream``; a GET of a path in ``fail_paths`` is answered
    ``503 SlowDown`` instead, counted in ``failed``; with ``delete_delay``, DELETEs are served
    one at a time, that long each (counted in ``deletes``)."""

    def __init__(self, upstream: str) -> None:
        url = urllib.parse.urlsplit(upstream)
        self.upstream = (url.hostname, url.port)
        self.fail_paths: set[str] = set()
        self.failed = 0
        self.delete_delay = 0.0  # > 0: DELETEs served one at a time, this many seconds each
        self.deletes = 0
        delete_lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.command == "GET" and urllib.parse.urlsplit(self.path).path in proxy.fail_paths:
                    proxy.failed += 1
                    self._send(503, [], b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>")
                    return
                if self.command == "DELETE" and proxy.delete_delay > 0:  # a store that deletes slowly
                    with delete_lock:
                        time.sleep(proxy.delete_delay)
                        proxy.deletes += 1
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    if body or self.command in ("PUT", "POST"):
                        headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body or None, headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    kept = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                    self._send(resp.status, kept, data, length)
                finally:
                    conn.close()

            def _send(self, code: int, headers: list, body: bytes, length: str | None = None) -> None:
                self.send_response(code)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", length or str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def proxy(s3):
    p = FailingProxy(s3.endpoint)
    yield p
    p.close()


def opts(srv: S3Server, endpoint: str, retries: int) -> zarrckpt.StorageOptions:
    return zarrckpt.StorageOptions(endpoint=endpoint, region=srv.region, access_key_id=srv.access_key,
                                   secret_access_key=srv.secret_key, request_retries=retries)


def st(v: int) -> dict:
    return {"w": torch.full((8, 4), float(v)), "step": v}


def test_a_503_on_the_newest_root_is_an_error_naming_it_not_a_rollback(s3, proxy):
    prefix = s3.fresh_prefix()
    url = s3.url(prefix + "run")
    with zarrckpt.CheckpointManager(url, storage=opts(s3, s3.endpoint, 2)) as direct:
        for step in (1, 2, 3):
            direct.save(step, st(step))
    root3 = f"/{s3.buckets[0]}/{prefix}run/step_00000003/zarr.json"
    proxy.fail_paths.add(root3)

    mgr = zarrckpt.CheckpointManager(url, storage=opts(s3, proxy.endpoint, 1))
    for call in (mgr.latest_step, mgr.steps, lambda: mgr.restore(st(0))):
        with pytest.raises(zarrckpt.StorageError, match=r"step_00000003.*503") as info:
            call()
        assert "not skipping it" in str(info.value)
    assert proxy.failed == 3 * 2  # each call: 1 request + 1 retry, then the error
    target = st(0)
    assert mgr.restore(target, step=2) == 2 and target["step"] == 2  # an explicit step still loads

    proxy.fail_paths.clear()  # the same manager, the endpoint answering again
    assert mgr.steps() == [1, 2, 3] and mgr.latest_step() == 3


def test_an_absent_or_pending_root_is_skipped_through_the_proxy(s3, proxy):
    prefix = s3.fresh_prefix()
    url = s3.url(prefix + "run")
    with zarrckpt.CheckpointManager(url, storage=opts(s3, s3.endpoint, 2)) as direct:
        for step in (1, 2, 3, 4):
            direct.save(step, st(step))
    bucket, base = s3.buckets[0], f"{prefix}run"
    s3.delete_object(bucket, f"{base}/step_00000004/zarr.json")  # a save that has just begun
    root3 = json.loads(s3.get_object(bucket, f"{base}/step_00000003/zarr.json"))
    root3["attributes"]["zarrckpt"]["state"] = "pending"  # a save that was interrupted
    s3.put_object(bucket, f"{base}/step_00000003/zarr.json", json.dumps(root3).encode())

    mgr = zarrckpt.CheckpointManager(url, storage=opts(s3, proxy.endpoint, 1))
    assert mgr.steps() == [1, 2] and mgr.latest_step() == 2
    target = st(0)
    assert mgr.restore(target) == 2 and target["step"] == 2
    assert proxy.failed == 0
    # a 503 on an older step's root is an error too: it cannot be told from a committed one
    proxy.fail_paths.add(f"/{bucket}/{base}/step_00000001/zarr.json")
    with pytest.raises(zarrckpt.StorageError, match="step_00000001"):
        mgr.latest_step()
