"""Tenants are identities (issue 35): API keys made with ``conductor keys``, each of a tenant, through
two real ``conductor serve`` replicas on one redis-server and the official ``openai`` SDK.

Each user key sees only its tenant's files and batches on every route (another's is the 404 of an id
that does not exist); the admin key sees both; a revoked key is refused by every replica within a
second; a batch past the tenant's enqueued-token limit is a 429 that writes nothing; the rate limit
answers 429 with Retry-After; bad Authorization headers are 401s that write nothing; every create,
cancel, retry, download and delete is in the audit stream. One Redis and two replicas serve the
whole module (each test uses tenants of its own)."""

from __future__ import annotations

import io
import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis
from openai import OpenAI

from conductor.embedded import EmbeddedRedis, free_port
from tests.conftest import ROOT, cli
from tests.test_serve import follow, jsonl, request, served, stop, worker


@dataclass
class Serve:
    base: str
    proc: subprocess.Popen
    log: Path

    def client(self, key: str, **kw) -> OpenAI:
        return OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, **kw)


def start_serve(url: str, data: Path, log: Path, *extra: str, scheme: str = "http", verify: object = True) -> Serve:
    port = free_port()
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url)
    env.pop("CONDUCTOR_API_KEYS", None)
    with open(log, "wb") as err:
        p = subprocess.Popen([sys.executable, "-m", "conductor", "serve", "--port", str(port), "--data-dir", str(data),
                              *extra], env=env, cwd=str(ROOT), stderr=err)
    base = f"{scheme}://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(base + "/v1/files", verify=verify, timeout=5)  # type: ignore[arg-type]
            return Serve(base, p, log)
        except httpx.TransportError:
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                p.wait()
                raise AssertionError(f"serve did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.1)


def new_key(url: str, tenant: str, role: str = "user") -> str:
    out = cli("keys", "create", "--tenant", tenant, "--role", role, "--name", f"{tenant} test", url=url)
    key = out.stdout.decode().splitlines()[-1]  # alone on the last line
    assert key.startswith("ck-") and " " not in key
    return key


@dataclass
class Env:
    url: str
    a: Serve
    b: Serve
    r: redis.Redis


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("tenants")
    srv = EmbeddedRedis().start()
    served(srv.url, "m", "idle")  # "idle": a model no worker serves, so its batches stay in progress
    new_key(srv.url, "ops", "admin")  # keys exist before the replicas start: their first line says so
    a = start_serve(srv.url, tmp / "files", tmp / "a.log")
    b = start_serve(srv.url, tmp / "files", tmp / "b.log")
    r = redis.Redis.from_url(srv.url)
    try:
        yield Env(srv.url, a, b, r)
    finally:
        r.close()
        for s in (a, b):
            s.proc.terminate()
            assert s.proc.wait(10) == 0
        srv.close()


def upload(client: OpenAI, rows: list[dict]) -> str:
    return client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch").id


def status_of(fn) -> tuple[int, dict]:  # noqa: ANN001
    try:
        fn()
    except openai.APIStatusError as e:
        return e.status_code, e.response.json()
    return 200, {}


def not_found_like_missing(fn_other, fn_missing, other_id: str, missing_id: str) -> None:  # noqa: ANN001
    """Another tenant's id answers exactly as an id that does not exist."""
    got, body = status_of(fn_other)
    want, missing = status_of(fn_missing)
    assert got == want == 404, (got, body)
    assert json.dumps(body).replace(other_id, "ID") == json.dumps(missing).replace(missing_id, "ID")


def others_are_missing(me: OpenAI, other_files: set[str], other_batch: str, other_input: str) -> None:
    """Every route on another tenant's files and batch answers as for ids that do not exist."""
    for fid in other_files:
        missing = fid[:-4] + ("1111" if fid.endswith("0000") else "0000")
        not_found_like_missing(lambda f=fid: me.files.retrieve(f), lambda m=missing: me.files.retrieve(m), fid, missing)
        not_found_like_missing(lambda f=fid: me.files.content(f), lambda m=missing: me.files.content(m), fid, missing)
        not_found_like_missing(lambda f=fid: me.files.delete(f), lambda m=missing: me.files.delete(m), fid, missing)
    missing_batch = "batch_" + "0" * 24
    not_found_like_missing(lambda: me.batches.retrieve(other_batch), lambda: me.batches.retrieve(missing_batch),
                           other_batch, missing_batch)
    not_found_like_missing(lambda: me.batches.cancel(other_batch), lambda: me.batches.cancel(missing_batch),
                           other_batch, missing_batch)
    not_found_like_missing(lambda: me.post(f"/batches/{other_batch}/retry", cast_to=httpx.Response, body={}),
                           lambda: me.post(f"/batches/{missing_batch}/retry", cast_to=httpx.Response, body={}),
                           other_batch, missing_batch)
    # a batch from the other tenant's file: as from a file that does not exist
    code, body = status_of(lambda: me.batches.create(input_file_id=other_input, endpoint="/v1/chat/completions",
                                                     completion_window="24h"))
    assert code == 400 and body["error"]["param"] == "input_file_id"


def state(r: redis.Redis) -> dict[bytes, bytes]:
    """Every key and its value (DUMP), but the audit trail, key records (last use), rate counters,
    leases and the served model's keys (a worker's heartbeats): what a refused request must not change."""
    skip = (b"cdr:audit", b"cdr:apikey:", b"cdr:lease:", b"cdr:{m}:")
    return {k: r.dump(k) for k in r.scan_iter(count=1000)
            if not k.startswith(skip) and b":rate:" not in k}


def test_each_tenant_sees_only_its_own_and_the_admin_sees_both(env):
    a_key, b_key, admin_key = new_key(env.url, "team-a"), new_key(env.url, "team-b"), new_key(env.url, "ops2", "admin")
    ca, cb, admin = env.a.client(a_key), env.b.client(b_key), env.a.client(admin_key)
    rows = [request(i) for i in range(6)]
    rows[2]["body"]["messages"][1]["content"] = "x" * 3000  # over the worker's input length: an error file
    fa, fb = upload(ca, rows), upload(cb, rows)
    ba = ca.batches.create(input_file_id=fa, endpoint="/v1/chat/completions", completion_window="24h").id
    bb = cb.batches.create(input_file_id=fb, endpoint="/v1/chat/completions", completion_window="24h",
                           metadata={"tenant": "team-b"}).id  # its own tenant named: allowed
    # the fair share bills the key's tenant (what jobs/tenants.py counts)
    assert env.r.hget(f"cdr:{{m}}:in:{ba}", "tenant") in (b"team-a", None)  # (None: not yet submitted)
    w = worker(env.url)
    try:
        done_a = follow(admin, ba, {"completed"})
        done_b = follow(admin, bb, {"completed"})
    finally:
        stop(w)
    assert env.r.hget(f"cdr:{{m}}:in:{ba}", "tenant") == b"team-a"
    assert env.r.hmget(f"cdr:job:{ba}:meta", "tenant", "key_id") == [b"team-a", a_key.split("-")[1].encode()]
    a_files = {fa, done_a.output_file_id, done_a.error_file_id}
    b_files = {fb, done_b.output_file_id, done_b.error_file_id}
    assert None not in a_files | b_files

    # lists: each its own, the admin both
    assert {f.id for f in ca.files.list()} == {fa} and {f.id for f in cb.files.list()} == {fb}
    assert {fa, fb} <= {f.id for f in admin.files.list()}
    assert [x.id for x in ca.batches.list()] == [ba] and [x.id for x in cb.batches.list()] == [bb]
    assert {ba, bb} <= {x.id for x in admin.batches.list()}

    others_are_missing(ca, b_files, bb, fb)
    others_are_missing(cb, a_files, ba, fa)

    # the owners (and the admin, on the other replica) read every one of their files
    for fid in a_files:
        assert ca.files.retrieve(fid).id == fid and admin.files.content(fid).content == ca.files.content(fid).content
    assert env.b.client(admin_key).batches.retrieve(bb).id == bb

    # a user key cannot name another tenant; an admin may act for one
    code, body = status_of(lambda: ca.batches.create(input_file_id=fa, endpoint="/v1/chat/completions",
                                                     completion_window="24h", metadata={"tenant": "team-b"}))
    assert code == 400 and body["error"]["param"] == "metadata.tenant" and "metadata.tenant" in body["error"]["message"]
    for_b = admin.batches.create(input_file_id=fa, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata={"tenant": "team-b"}).id
    assert cb.batches.retrieve(for_b).id == for_b
    assert status_of(lambda: ca.batches.retrieve(for_b))[0] == 404

    # the owner retries, cancels and deletes its own
    retried = ca.post(f"/batches/{ba}/retry", cast_to=httpx.Response, body={"include_permanent": True}).json()
    assert retried["metadata"]["retry_of"] == ba and ca.batches.retrieve(retried["id"]).id == retried["id"]
    assert status_of(lambda: cb.batches.retrieve(retried["id"]))[0] == 404
    assert ca.batches.cancel(retried["id"]).status in ("cancelling", "cancelled")
    assert ca.files.delete(fa).deleted and status_of(lambda: ca.files.retrieve(fa))[0] == 404
    assert cb.files.retrieve(fb).id == fb  # the other tenant's delete attempts above left it

    # the audit trail: each route with the key and its outcome
    rows_a = json.loads(cli("audit", "--tenant", "team-a", "--json", "--limit", "1000", url=env.url).stdout)
    a_id = a_key.split("-")[1]
    got = {(x["action"], x["outcome"]) for x in rows_a if x["key"] == a_id}
    assert {("file.create", "ok"), ("batch.create", "ok"), ("batch.retry", "ok"), ("batch.cancel", "ok"),
            ("file.delete", "ok"), ("file.download", "ok"), ("batch.cancel", "refused"),
            ("batch.retry", "refused"), ("file.download", "refused"), ("file.delete", "refused"),
            ("batch.create", "refused")} <= got, got
    refused = [x for x in rows_a if x["key"] == a_id and x["action"] == "batch.cancel" and x["target"] == bb]
    assert refused and refused[0]["status"] == "404" and refused[0]["route"] == f"POST /v1/batches/{bb}/cancel"
    created = [x for x in rows_a if x["action"] == "batch.create" and x["outcome"] == "ok"]
    assert ba in {x["target"] for x in created}
    assert f"audit: batch.create POST /v1/batches key={a_id} tenant=team-a target={ba}" in \
        env.a.log.read_text() + env.b.log.read_text()  # in the log too
    text = cli("audit", "--tenant", "team-b", url=env.url).stdout.decode()
    assert "batch.create" in text and "team-a" not in text
    # the admin's batch for team-b is recorded as the admin's act
    assert any(x["target"] == for_b for x in json.loads(cli("audit", "--json", "--limit", "1000",
                                                            url=env.url).stdout))


def test_a_revoked_key_is_refused_by_every_replica_within_a_second(env):
    key = new_key(env.url, "team-c")
    key_id = key.split("-")[1]
    for s in (env.a, env.b):  # both replicas know (and cache) the key
        assert s.client(key).files.list().data == []
    listed = cli("keys", "list", url=env.url).stdout.decode()
    assert key_id in listed and key.split("-", 2)[2] not in listed
    assert key.split("-", 2)[2].encode() not in b"".join(v for v in env.r.hvals(f"cdr:apikey:{key_id}"))
    cli("keys", "revoke", key_id, url=env.url)
    revoked_at = time.monotonic()
    while True:
        code = httpx.get(env.b.base + "/v1/files", headers={"Authorization": f"Bearer {key}"}).status_code
        if code == 401:
            break
        assert time.monotonic() - revoked_at < 1.0, "replica b still took the revoked key after a second"
        time.sleep(0.02)
    assert time.monotonic() - revoked_at < 1.0
    assert httpx.get(env.a.base + "/v1/files", headers={"Authorization": f"Bearer {key}"}).status_code == 401
    rows = json.loads(cli("keys", "list", "--json", url=env.url).stdout)
    mine = [x for x in rows if x["id"] == key_id][0]
    assert mine["revoked"] and mine["last_used"] and mine["tenant"] == "team-c" and "hash" not in mine
    assert cli("keys", "revoke", key_id, url=env.url, check=False).returncode == 2  # once


def test_a_batch_over_the_enqueued_token_limit_is_refused_and_writes_nothing(env):
    key = new_key(env.url, "team-t")
    c = env.b.client(key)
    rows = [request(i, model="idle") for i in range(20)]
    f1, f2 = upload(c, rows), upload(c, rows)
    tokens = int(env.r.hget(f"cdr:file:{f1}", "input_tokens"))
    assert tokens > 0
    cli("tenant", "team-t", "--max-enqueued-tokens", str(tokens + tokens // 2), url=env.url)
    first = c.batches.create(input_file_id=f1, endpoint="/v1/chat/completions", completion_window="24h")
    follow(c, first.id, {"in_progress"})  # its intake done: nothing moves in Redis any more
    time.sleep(1.2)  # the replicas' limit caches (0.5 s) have the new limit
    before = state(env.r)
    files_before = [f.id for f in c.files.list()]
    code, body = status_of(lambda: c.batches.create(input_file_id=f2, endpoint="/v1/chat/completions",
                                                    completion_window="24h"))
    assert code == 429 and body["error"]["code"] == "token_limit_exceeded", body
    assert str(tokens + tokens // 2) in body["error"]["message"]
    assert state(env.r) == before  # no batch, job, item, task or file left behind
    assert [f.id for f in c.files.list()] == files_before and [b.id for b in c.batches.list()] == [first.id]
    use = json.loads(cli("tenants", "--limits", "--json", url=env.url).stdout)
    mine = [u for u in use if u["tenant"] == "team-t"][0]
    assert mine["enqueued_tokens"] == tokens and mine["limits"]["max_enqueued_tokens"] == tokens + tokens // 2
    table = [ln for ln in cli("tenants", url=env.url).stdout.decode().splitlines() if ln.startswith("team-t ")]
    assert any(f"{tokens:,} / {tokens + tokens // 2:,}" in ln for ln in table)  # (after its fair-share row)
    # an ended batch counts no more: the same batch goes through once the first is cancelled
    c.batches.cancel(first.id)
    second = c.batches.create(input_file_id=f2, endpoint="/v1/chat/completions", completion_window="24h")
    assert second.status in ("validating", "in_progress")
    c.batches.cancel(second.id)


def test_the_rate_limit_answers_429_with_retry_after(env):
    key = new_key(env.url, "team-r")
    cli("tenant", "team-r", "--requests-per-minute", "3", url=env.url)
    time.sleep(0.6)  # past the replicas' limit caches
    got = []
    for _ in range(8):  # a minute window that turns over meanwhile only lets three more through
        resp = httpx.get(env.a.base + "/v1/batches", headers={"Authorization": f"Bearer {key}"})
        got.append(resp)
    codes = [x.status_code for x in got]
    assert codes[:3] == [200, 200, 200] or codes.count(429) >= 4, codes
    refused = [x for x in got if x.status_code == 429]
    assert refused and all(1 <= int(x.headers["retry-after"]) <= 60 for x in refused)
    assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
    # the SDK sees a RateLimitError
    with pytest.raises(openai.RateLimitError):
        env.a.client(key).batches.list()
    cli("tenant", "team-r", "--requests-per-minute", "0", url=env.url)


def test_an_upload_over_the_tenants_file_limit_is_refused_naming_it(env):
    key = new_key(env.url, "team-f")
    cli("tenant", "team-f", "--max-file-bytes", "300", url=env.url)
    time.sleep(0.6)
    c = env.a.client(key)
    small = jsonl([request(0)])
    assert len(small) < 300 and c.files.create(file=("s.jsonl", io.BytesIO(small)), purpose="batch").bytes
    with pytest.raises(openai.APIStatusError) as e:
        c.files.create(file=("big.jsonl", io.BytesIO(jsonl([request(i) for i in range(10)]))), purpose="batch")
    assert e.value.status_code == 413 and "300 bytes" in e.value.response.json()["error"]["message"]
    # one whose declared length is far past it: refused by the gate before its body is read
    with pytest.raises(openai.APIStatusError) as e:
        c.files.create(file=("huge.jsonl", io.BytesIO(b"x" * 200_000)), purpose="batch")
    assert e.value.status_code == 413 and e.value.response.json()["error"]["code"] == "file_too_large"
    assert len(c.files.list().data) == 1
    assert not list((Path(env.a.log).parent / "files").glob(".*.part"))


def test_bad_authorization_headers_are_401_and_write_nothing(env):
    key = new_key(env.url, "team-h")
    key_id = key.split("-")[1]
    cli("keys", "revoke", key_id, url=env.url)
    stored_hash = env.r.hget(f"cdr:apikey:{key_id}", "hash").decode()
    live = new_key(env.url, "team-h")
    time.sleep(0.6)
    body = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    cases: list[list[tuple[bytes, bytes]]] = [
        [(b"Authorization", b"")],
        [(b"Authorization", b"Bearer")],
        [(b"Authorization", b"bearer\t" + b"ck-0")],  # (a value ending in a space is refused by the client itself)
        [(b"Authorization", b"Bearer " + b"x" * 20000)],
        [(b"Authorization", b"Bearer ck-" + "é".encode("latin-1") * 40)],
        [(b"Authorization", "Bearer ck-ü".encode())],
        [(b"Authorization", b"Bearer " + live.encode()), (b"Authorization", b"Bearer " + live.encode())],
        [(b"Authorization", b"Bearer " + key.encode())],
        [(b"Authorization", b"Bearer " + stored_hash.encode())],
        [(b"Authorization", b"Bearer ck-" + key_id.encode() + b"-" + stored_hash.encode())],
        [(b"Authorization", b"Basic " + live.encode())],
        [],
    ]
    before = {k: env.r.dump(k) for k in env.r.scan_iter(count=1000) if not k.startswith((b"cdr:{m}:", b"cdr:lease:"))}
    with httpx.Client() as h:
        for headers in cases:
            for method, path in (("GET", "/v1/files"), ("POST", "/v1/batches"), ("GET", "/")):
                req = h.build_request(method, env.a.base + path, json=body if method == "POST" else None)
                req.headers = httpx.Headers([*[(k, v) for k, v in req.headers.raw if k.lower() != b"authorization"],
                                             *headers])
                resp = h.send(req)
                assert resp.status_code == 401, (headers[:1], path, resp.status_code, resp.text[:200])
                assert resp.json()["error"]["code"] == "invalid_api_key"
                assert live.encode() not in resp.content and b"x" * 100 not in resp.content
    after = {k: env.r.dump(k) for k in env.r.scan_iter(count=1000) if not k.startswith((b"cdr:{m}:", b"cdr:lease:"))}
    assert after == before
    assert httpx.get(env.a.base + "/v1/files", headers={"Authorization": f"Bearer {live}"}).status_code == 200
    # a user key does not see the status page (every tenant's jobs); an admin's does
    assert httpx.get(env.a.base + "/", headers={"Authorization": f"Bearer {live}"}).status_code == 403


def test_serve_says_in_its_first_line_whether_it_is_open(env, tmp_path):
    assert "keys: the API keys in Redis" in env.a.log.read_text().splitlines()[0]
    srv = EmbeddedRedis().start()
    try:
        s = start_serve(srv.url, tmp_path / "files", tmp_path / "open.log")
        try:
            first = s.log.read_text().splitlines()[0]
            assert "OPEN" in first and "anyone" in first
            assert s.client("anything").files.list().data == []  # open: any key, or none
        finally:
            s.proc.terminate()
            assert s.proc.wait(10) == 0
    finally:
        srv.close()


def _certificates(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for 127.0.0.1: (CA file, certificate, its key)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "conductor test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def test_tls_with_the_sdk_and_the_tests_ca(env, tmp_path):
    ca, cert, key = _certificates(tmp_path)
    admin = new_key(env.url, "ops", "admin")
    trust = ssl.create_default_context(cafile=str(ca))
    s = start_serve(env.url, tmp_path / "files", tmp_path / "tls.log", "--tls-cert", str(cert), "--tls-key",
                    str(key), scheme="https", verify=trust)
    try:
        assert "https://" in s.log.read_text().splitlines()[0]
        with httpx.Client(verify=trust) as http:
            c = OpenAI(base_url=s.base + "/v1", api_key=admin, http_client=http, max_retries=0)
            f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl([request(0)]))), purpose="batch")
            assert c.files.retrieve(f.id).bytes == f.bytes
        with httpx.Client() as untrusting, pytest.raises(httpx.ConnectError):  # the system's CAs do not know it
            untrusting.get(s.base + "/v1/files")
    finally:
        s.proc.terminate()
        assert s.proc.wait(10) == 0
