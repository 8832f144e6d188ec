"""An object store that goes away in the middle of a save (issue 18, item 17): the first
request that exhausts its retries aborts the whole save, so the time to fail is bounded by
one request's retries, not by the number of arrays."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest
import torch

import zarrckpt
from zarrckpt.engine import commit as _commit


class DyingS3:
    """Just enough of S3 for a save to begin (GET: absent, PUT/DELETE/POST: done), until
    ``dead`` is set: from then on every request gets its connection closed unanswered."""

    def __init__(self) -> None:
        self.dead = False
        self.requests_after_death = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def handle_one_request(self) -> None:
                if server.dead:
                    server.requests_after_death += 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                super().handle_one_request()

            def _reply(self, code: int, body: bytes = b"", headers: tuple = ()) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(code)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if "list-type" in self.path:
                    self._reply(200, b'<?xml version="1.0"?><ListBucketResult><KeyCount>0</KeyCount>'
                                     b"<IsTruncated>false</IsTruncated></ListBucketResult>")
                else:
                    self._reply(404, b"<Error><Code>NoSuchKey</Code></Error>")

            def do_HEAD(self) -> None:
                self._reply(200, headers=[("x-amz-bucket-region", "us-east-1")])

            def do_PUT(self) -> None:
                self._reply(200, headers=[("ETag", '"0"')])

            def do_DELETE(self) -> None:
                self._reply(204)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def dying_s3(monkeypatch):
    """A fake S3 endpoint that dies once rank 0 has begun the save (claimed the location)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    server = DyingS3()
    real = _commit.begin

    def begin_then_die(*args, **kwargs):
        target = real(*args, **kwargs)
        server.dead = True
        return target

    monkeypatch.setattr(_commit, "begin", begin_then_die)
    yield server
    server.close()


def _time_to_fail(server: DyingS3, n_small: int, n_large: int, prefix: str) -> float:
    sd = {f"s{i}": torch.full((16,), float(i)) for i in range(n_small)}
    # chunks over 1 MiB go through TensorStore's zarr3 driver, not the small-chunk puts
    sd.update({f"big{i}": torch.ones(512, 1024) for i in range(n_large)})
    options = zarrckpt.StorageOptions(endpoint=server.endpoint, request_retries=2)
    server.dead = False
    t0 = time.monotonic()
    with pytest.raises(zarrckpt.StorageError, match="unreachable or failing") as ei:
        zarrckpt.save(sd, f"s3://zarrckpt-test/{prefix}", pack_bytes=0, storage=options)
    assert "retry attempts failed" in str(ei.value)
    return time.monotonic() - t0


def test_dead_endpoint_fails_in_one_requests_retries_whatever_the_number_of_arrays(dying_s3):
    one = _time_to_fail(dying_s3, 1, 0, "one")  # one request's retries (+ the save's overhead)
    many = _time_to_fail(dying_s3, 1000, 4, "many")  # 2,000 small requests, 4 TensorStore arrays
    # before: each request queued behind the others exhausted its own retries (~1.5 s per 10
    # arrays here); now the first failure cancels everything still queued
    assert many < 2 * one + 5, (one, many)
    assert dying_s3.requests_after_death < 200  # nowhere near 2,000 requests were attempted


# ------------------------------------------------- the same rule, counted on the fault store


@pytest.mark.parametrize("object_store", [True, False])
def test_first_failed_write_stops_the_other_writes_on_object_stores(object_store):
    """The rule above, counted in requests instead of seconds: on an object store the first
    write that fails stops the save's other writes (queued ones are cancelled, no new ones
    issued); a file system's save waits for every write it issued (it has no retries)."""
    from zarrckpt.storage import FaultStorage
    from zarrckpt.storage.memory import unavailable

    store = FaultStorage(object_store=object_store).slow(0.005, ops="put")
    store.fail(ops="put", keys="s*/zarr.json", times=1, error=unavailable("All 3 retry attempts failed"))
    sd = {f"s{i}": torch.full((16,), float(i)) for i in range(1000)}
    with pytest.raises(zarrckpt.StorageError, match="unreachable or failing"):
        zarrckpt.save(sd, store, pack_bytes=0)
    ran = sum(1 for e in store.events if e.op == "put")
    if object_store:
        assert ran < 200, ran  # nowhere near the 2,000 puts of the save
    else:
        assert ran == store.counts["put"] and ran > 1000, ran
