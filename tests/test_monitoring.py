"""The monitoring stack's files (Prometheus and Grafana do not run here): every metric the
dashboard, the alert rules and the KEDA example name is one that a live exporter or worker
serves (both started for real against a redis-server and scraped); the compose file's scrape
targets are services and ports of that file; Redis there is durable and bounded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import yaml

from conductor.embedded import free_port
from tests.conftest import ROOT, item
from tests.helpers import quick
from tests.test_exporter import exporter, scrape

DEPLOY = ROOT / "deploy"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
PROM = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
RULES = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
DASHBOARD = json.loads((DEPLOY / "grafana" / "dashboards" / "conductor.json").read_text())
KEDA = yaml.safe_load((DEPLOY / "keda" / "scaledobject.yaml").read_text())
METRIC = re.compile(r"\bconductor_[a-z0-9_]+")


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]


def rules() -> list[dict]:
    return [r for g in RULES["groups"] for r in g["rules"]]


def named_metrics() -> set[str]:
    keda = [t["metadata"]["query"] for t in KEDA["spec"]["triggers"]]
    exprs = dashboard_exprs() + [r["expr"] for r in rules()] + keda
    return {m for e in exprs for m in METRIC.findall(e)}


def test_every_metric_the_dashboard_rules_and_keda_name_is_served_live(redis_url, cdr, tmp_path):
    quick(cdr, "demo-7b")
    cdr.submit([item(f"i{k}", 20 + k % 50, model="demo-7b", prefix=(f"S{k % 4}",)) for k in range(200)], "j")
    port = free_port()
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url, CONDUCTOR_VERIFY_INTERVAL_S="0.5")
    log = open(tmp_path / "worker.log", "wb")  # the child writes it until it exits
    w = subprocess.Popen([sys.executable, "-m", "conductor", "worker", "--engine", "sim", "--model", "demo-7b",
                          "--name", "w1", "--max-batch-size", "16", "--metrics-port", str(port)],
                         env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log)
    try:
        with exporter(redis_url) as eport:
            deadline = time.monotonic() + 60
            finished = ("conductor_finished_sequences_total", (("model", "demo-7b"), ("worker", "w1")))
            while True:
                # the job's status first, then the scrape: a scrape taken before the status read may
                # miss the last batch's sequences (the worker counts them after its complete)
                done = cdr.status("j")["done"]
                worker_side = scrape(port)
                if done and worker_side.get(finished) == 200 and ("conductor_counter_drift", (
                        ("counter", "state.tokens"), ("model", "demo-7b"), ("worker", "w1"))) in worker_side:
                    break
                assert time.monotonic() < deadline, "the worker did not finish and run its drift check"
                time.sleep(0.2)
            broker_side = scrape(eport)
    finally:
        w.send_signal(signal.SIGTERM)
        assert w.wait(30) == 0
        log.close()
    served = {name for name, _ in worker_side} | {name for name, _ in broker_side}
    wanted = named_metrics()
    assert len(wanted) >= 15, sorted(wanted)
    missing = sorted(wanted - served)
    assert not missing, f"named in deploy/ but served by neither the exporter nor a worker: {missing}"
    # each side serves its own: the exporter has no worker series (they would read 0 under no worker)
    assert not [n for n, _ in broker_side if n.startswith("conductor_finished_sequences")]
    assert worker_side[finished] == 200


def test_every_series_the_dashboard_and_alerts_name_is_served_from_the_start(redis_url, tmp_path):
    """Issue 29: the drift panel was blank on a healthy system, conductor_counter_drift appearing only
    after the first periodic check (60 s). Here, with the default interval, a worker that has not
    run anything and an exporter serve every named series within seconds of starting."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "CONDUCTOR_VERIFY_INTERVAL_S"}
    env["CONDUCTOR_REDIS_URL"] = redis_url
    w = subprocess.Popen([sys.executable, "-m", "conductor", "worker", "--engine", "sim", "--model", "demo-7b",
                          "--create", "--name", "w1", "--metrics-port", str(port)],
                         env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with exporter(redis_url) as eport:
            deadline = time.monotonic() + 30
            while True:
                served = {name for name, _ in scrape(port)} | {name for name, _ in scrape(eport)}
                missing = sorted(named_metrics() - served)
                if not missing:
                    break
                assert time.monotonic() < deadline, f"not served 30 s after the start: {missing}"
                time.sleep(0.2)
    finally:
        w.send_signal(signal.SIGTERM)
        assert w.wait(30) == 0


def _ports(service: dict) -> set[int]:
    """The ports a service of the compose file listens on, from its command line."""
    cmd = service.get("command", [])
    ports = {int(cmd[i + 1]) for i, a in enumerate(cmd[:-1]) if a in ("--port", "--metrics-port")}
    ports |= {int(a.rsplit(":", 1)[1]) for a in cmd if a.startswith("--web.listen-address=")}
    return ports


def _scrape_targets() -> list[tuple[str, str, int]]:
    out = []
    for job in PROM["scrape_configs"]:
        for sc in job.get("static_configs", []):
            for t in sc["targets"]:
                host, port = t.rsplit(":", 1)
                out.append((job["job_name"], host, int(port)))
        for sd in job.get("dns_sd_configs", []):
            out += [(job["job_name"], name, int(sd["port"])) for name in sd["names"]]
    return out


def test_every_scrape_target_is_a_service_and_port_of_the_compose_file():
    services = COMPOSE["services"]
    targets = _scrape_targets()
    assert {host for _, host, _ in targets} == {"exporter", "worker"}
    for job, host, port in targets:
        assert host in services, f"{job}: {host} is no service of docker-compose.yml"
        assert port in _ports(services[host]), f"{job}: {host} does not listen on {port}"
    assert services["worker"]["deploy"]["replicas"] == 2
    assert any("dns_sd_configs" in j for j in PROM["scrape_configs"])  # every replica, not one at random
    # the rule file Prometheus loads is this folder's, as mounted
    mount = next(v for v in services["prometheus"]["volumes"] if v.endswith(":/etc/prometheus:ro"))
    assert (ROOT / mount.split(":")[0]).resolve() == (DEPLOY / "prometheus").resolve()
    assert PROM["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    # Grafana reads Prometheus where it listens, and the dashboard folder it is given
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    url = ds["datasources"][0]["url"]
    host, port = url.split("//")[1].rsplit(":", 1)
    assert host in services and int(port) in _ports(services[host])
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "conductor.yml").read_text())
    mounts = dict(reversed(v.rsplit(":", 2)[:2]) for v in services["grafana"]["volumes"])
    folder = ROOT / mounts[prov["providers"][0]["options"]["path"]]
    assert (folder / "conductor.json").exists()
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    uid = ds["datasources"][0]["uid"]
    assert {t["datasource"]["uid"] for p in DASHBOARD["panels"] for t in p["targets"]} == {uid}


def test_redis_in_compose_is_durable_bounded_and_healthchecked():
    services = COMPOSE["services"]
    cmd = services["redis"]["command"]
    opts = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert opts["--appendonly"] == "yes" and opts["--appendfsync"] == "always"
    assert opts["--maxmemory-policy"] == "noeviction" and re.fullmatch(r"\d+[kmg]b", opts["--maxmemory"])
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]
    for name in ("exporter", "worker"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert services[name]["environment"]["CONDUCTOR_REDIS_URL"] == "redis://redis:6379/0"
    assert services["exporter"]["command"][0] == "exporter"
    assert services["worker"]["command"][:3] == ["worker", "--engine", "sim"]


def test_the_alert_rules_and_the_dashboard_cover_what_an_operator_watches():
    by_name = {r["alert"]: r for r in rules()}
    assert {"ConductorBacklogWithoutWorker", "ConductorDeadLettersRising", "ConductorCounterDrift",
            "ConductorShapeThrashing"} <= set(by_name)
    for r in by_name.values():
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
        assert r["expr"].count("(") == r["expr"].count(")")
    assert "conductor_workers_alive" in by_name["ConductorBacklogWithoutWorker"]["expr"]
    titles = " | ".join(p["title"].lower() for p in DASHBOARD["panels"])
    for topic in ("queue depth", "finished", "padding", "fill", "prefix", "shape switches", "claim latency",
                  "dead letters", "workers alive", "drift"):
        assert topic in titles, topic
    for e in dashboard_exprs():
        assert e.count("(") == e.count(")"), e
    assert "conductor_waiting_tokens" in METRIC.findall(KEDA["spec"]["triggers"][0]["metadata"]["query"])
    assert KEDA["kind"] == "ScaledObject" and KEDA["apiVersion"] == "keda.sh/v1alpha1"
    assert KEDA["spec"]["triggers"][0]["type"] == "prometheus"


def test_the_operations_page_explains_every_alert_and_the_scaling_signal():
    readme = (ROOT / "docs" / "operations.md").read_text()
    section = readme[readme.index("## Operating it"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    for r in rules():
        assert f"`{r['alert']}`" in section, r["alert"]
    for needle in ("conductor_waiting_tokens", "deploy/keda/scaledobject.yaml", "conductor jobs", "docker compose up",
                   "conductor exporter"):
        assert needle in section, needle
