"""TLS: a redis-server started with a self-signed CA and certificate made here (openssl CLI);
submit, claim and complete over rediss:// with ssl_ca_certs, a real worker process and the
results CLI too; a client that does not trust the CA gets one clear error."""

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from conductor.client import Conductor, connect
from conductor.embedded import free_port
from conductor.errors import RedisUnavailable
from conductor.redis_contract.records import Contract
from tests.conftest import ROOT, cli, item
from tests.helpers import quick, results_for
from tests.secure_redis import SecureRedis


def openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    assert exe, "the openssl CLI is needed to make the test certificate (Debian: apt-get install openssl)"
    p = subprocess.run([exe, *args], cwd=cwd, capture_output=True, timeout=60)
    assert p.returncode == 0, f"openssl {' '.join(args)}: {p.stderr.decode()[-1000:]}"


def make_certs(d: Path) -> dict[str, Path]:
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=conductor test CA",
            cwd=d)
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return {"ca": d / "ca.crt", "cert": d / "server.crt", "key": d / "server.key"}


@pytest.fixture(scope="module")
def tls_url(tmp_path_factory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("tls")
    certs = make_certs(d)
    port = free_port()
    args = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs["cert"]),
            "--tls-key-file", str(certs["key"]), "--tls-ca-cert-file", str(certs["ca"]), "--tls-auth-clients", "no"]
    try:
        srv = SecureRedis(d, args, lambda: redis.Redis(host="127.0.0.1", port=port, ssl=True,
                                                        ssl_ca_certs=str(certs["ca"]), socket_timeout=2)).start()
    except AssertionError as e:
        raise AssertionError(f"redis-server would not start with TLS (is it built with TLS support?): {e}") from None
    yield f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs['ca']}"
    srv.stop()


def test_submit_claim_complete_over_tls(tls_url, tmp_path):
    cdr = Conductor(connect(tls_url))
    assert cdr.r.connection_pool.connection_class.__name__ == "SSLConnection"
    cdr.r.flushall()
    quick(cdr)
    assert cdr.submit([item(i, 10 + i % 20) for i in range(200)], "j").accepted == 200
    b, _ = cdr.claim(Contract(model="m", max_batch_size=8, max_batch_tokens=8192, max_input_len=4096), "w")
    assert cdr.complete(b, results_for(b)) == (8, 1)
    # a real worker process and the results CLI, both over rediss://
    p = subprocess.run([sys.executable, "-m", "conductor", "--redis", tls_url, "--log-level", "warning", "worker",
                        "--engine", "sim", "--model", "m", "--idle-exit", "1"], cwd=str(ROOT),
                       capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    out = tmp_path / "r.jsonl"
    cli("results", "j", "-o", str(out), url=tls_url)
    ids = sorted(int(json.loads(x)["id"]) for x in out.read_text().splitlines())
    assert ids == list(range(200))


def test_a_client_that_does_not_trust_the_ca_is_refused_clearly(tls_url):
    plain = tls_url.split("?")[0]
    with pytest.raises(RedisUnavailable, match="TLS with Redis at rediss://127.0.0.1:.* failed"):
        connect(plain, timeout=2)
