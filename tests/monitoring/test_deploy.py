"""deploy/: promtool on the rules and configs, structure of the dashboard, compose and k8s files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from tests.helpers.monitoring import DEPLOY, need_binary, rank_status
from vllm_deltasync.server import metrics

PROM = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "vllm-deltasync.json"
NAME = re.compile(r"\b(?:[a-z_]+:)?deltasync_[a-z0-9_]+(?::[a-z0-9_]+)?\b")


def exported_names() -> set[str]:
    """Every sample name the code can export (one rank fed with every kind of value)."""
    m = metrics.SyncMetrics(registry=CollectorRegistry(), bucket_url="file:///b", format_version=1)
    stats = metrics.WorkerStats()
    stats.add_download("delta", 1, 0.1)
    stats.add_apply("delta", 0.1, 1)
    stats.add_failure("download", "TransientStoreError: x")
    m.update([rank_status(0, applied_step=1, newest_step=1, staged_step=1, last_error="E: x",
                          applied_published_at=1.0, newest_published_at=1.0, staged_bytes=1,
                          last_discovery_at=1.0, counters=stats.snapshot(
                              type("S", (), {"requests": {("read", "ok"): 1}})()))])
    m.observe_switch(1, 0.1)
    m.observe_admission(2)
    m.count_conflict("min_timeout")
    return {s.name for family in m.registry.collect() for s in family.samples}


def rule_exprs() -> dict[str, str]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return {r.get("alert") or r["record"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def record_names() -> set[str]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    binary = need_binary("promtool")
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.prometheus
@pytest.mark.parametrize("args", [
    ("check", "rules", "alerts.yml"),
    ("test", "rules", "alerts_test.yml"),
    ("check", "config", "prometheus.yml"),
    ("check", "config", "kubernetes-scrape.yml"),
])
def test_promtool(args: tuple[str, ...]) -> None:
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


@pytest.mark.prometheus
def test_promtool_rule_tests_can_fail(tmp_path: Path) -> None:
    """The rule tests are not vacuous: a raised threshold makes them fail."""
    for name in ("alerts.yml", "alerts_test.yml"):
        shutil.copy(PROM / name, tmp_path / name)
    rules = tmp_path / "alerts.yml"
    rules.write_text(rules.read_text().replace("instance:deltasync_steps_behind:max > 4",
                                               "instance:deltasync_steps_behind:max > 40"))
    result = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode != 0 and "DeltaSyncStaleSteps" in result.stdout + result.stderr


def test_every_metric_named_in_rules_and_dashboard_is_exported() -> None:
    known = exported_names() | record_names()
    used = {n for e in [*rule_exprs().values(), *dashboard_exprs()] for n in NAME.findall(e)}
    assert used, "no metric names found in the rules or the dashboard"
    assert used <= known, f"not exported by vllm_deltasync.server.metrics: {sorted(used - known)}"


VLLM_NAME = re.compile(r"\bvllm:[a-z0-9_]+\b")


def test_the_vllm_series_the_dashboard_reads_are_documented() -> None:
    """vLLM's own series (speculative acceptance) are named in the README; that a real engine
    exports them is checked by tests/engine/test_drafter.py from the same dashboard."""
    used = {n for e in dashboard_exprs() for n in VLLM_NAME.findall(e)}
    assert used == {"vllm:spec_decode_num_accepted_tokens_total",
                    "vllm:spec_decode_num_draft_tokens_total"}, used
    readme = (DEPLOY.parent / "README.md").read_text()
    assert all(f"`{n}`" in readme for n in used)


def test_dashboard_structure() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for needed in ("steps behind", "seconds behind", "download rate", "apply duration",
                   "pause", "failures", "429"):
        assert needed in titles, f"dashboard lacks a panel about {needed!r}"
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["expr"].strip() and t["refId"] for t in p["targets"])
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, p["title"]


def test_grafana_provisioning() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    dashboards = yaml.safe_load((prov / "dashboards" / "vllm-deltasync.yaml").read_text())
    provider = dashboards["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_compose_services_and_mounts() -> None:
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    assert set(services) == {"rollout", "prometheus", "grafana", "mirror"}
    rollout = services["rollout"]
    assert "vllm_deltasync.DeltaSyncExtension" in rollout["command"]
    assert (DEPLOY / rollout["build"]["context"] / rollout["build"]["dockerfile"]).is_file()
    assert "VLLM_DELTASYNC_URL" in rollout["environment"]
    assert "9464:9464" in rollout["ports"]
    mirror = services["mirror"]
    assert mirror["profiles"] == ["mirror"] and "VLLM_DELTASYNC_MIRRORS" in rollout["environment"]
    rendered = {v.split(":")[1] for v in mirror["volumes"] if v.startswith(".")}
    assert rendered == {"/etc/nginx/templates/deltasync-mirror.conf.template"}
    # every variable the template uses is set by the service (the image's envsubst fills them)
    template = (DEPLOY / "nginx" / "deltasync-mirror.conf.template").read_text()
    assert set(re.findall(r"\$\{(MIRROR_[A-Z_]+)\}", template)) == set(mirror["environment"])
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"compose mounts missing {source}"
    prom = yaml.safe_load((PROM / "prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["rollout:9464"]


def test_dockerfile_from_upstream_vllm() -> None:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v\d", text, re.M)
    assert "FROM ${VLLM_IMAGE}" in text and "EXPOSE 8000 9464" in text
    for src in re.findall(r"^COPY (.+) /opt/", text, re.M):
        for path in src.split():
            assert (DEPLOY.parent / path).exists(), f"Dockerfile copies missing {path}"


def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_k8s_manifests() -> None:
    docs = k8s_docs()
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), d
        assert d["metadata"].get("name"), d
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    deploy = by_kind[("Deployment", "vllm-deltasync")]
    spec = deploy["spec"]
    assert spec["replicas"] >= 2
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    pod = spec["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9464"
    [container] = pod["spec"]["containers"]
    assert "vllm_deltasync.DeltaSyncExtension" in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"].startswith("/synced")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["deltasync"] == 9464
    refs = {k: v["name"] for e in container["envFrom"] for k, v in e.items()}
    assert refs["secretRef"] == by_kind[("Secret", "vllm-deltasync-bucket")]["metadata"]["name"]
    config = by_kind[("ConfigMap", "vllm-deltasync")]["data"]
    assert config["VLLM_DELTASYNC_URL"] and "MODEL" in config
    headless = by_kind[("Service", "vllm-deltasync-metrics")]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    scrape = yaml.safe_load((PROM / "kubernetes-scrape.yml").read_text())
    name = scrape["scrape_configs"][0]["dns_sd_configs"][0]["names"][0]
    assert name.startswith("vllm-deltasync-metrics.vllm-deltasync.svc")
    kustom = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert all((DEPLOY / "k8s" / r).is_file() for r in kustom["resources"])
