"""Helpers of the metrics and monitoring tests: samples and exposition text, a real Prometheus
on loopback, and a rank's status as the engine core parses it."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.net import free_port, http_get

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """One sample's value from ``registry`` (None when there is no such series)."""
    return registry.get_sample_value(name, labels)


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text format -> {(sample name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def need_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed: run scripts/setup.sh (Debian package 'prometheus')")
    return path


class Prometheus:
    """A real Prometheus server on loopback with its own data directory."""

    def __init__(self, binary: str, workdir: Path, config: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (workdir / "prometheus.yml").write_text(config)
        self.log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.workdir = workdir
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.logs()}")
            try:
                if http_get(f"{self.url}/-/ready", timeout=1)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout}s: {self.logs()}")

    def logs(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-3000:]

    def query(self, expr: str) -> dict[str, Any]:
        """The API answer (``status``, ``data``/``error``) of an instant query."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        return json.loads(http_get(url)[1])

    def value(self, expr: str) -> float | None:
        """The single value of ``expr`` (None when it returns no series)."""
        answer = self.query(expr)
        assert answer["status"] == "success", (expr, answer)
        result = answer["data"]["result"]
        if not result:
            return None
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def wait_for(self, expr: str, predicate: Any, timeout: float = 60.0) -> float | None:
        """Poll ``expr`` until ``predicate(value)`` holds; the last value otherwise."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.value(expr)
            if predicate(value):
                return value
            time.sleep(0.5)
        raise AssertionError(f"{expr} stayed at {value} for {timeout}s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def scrape_config(targets: list[str], interval: str = "1s") -> str:
    """A Prometheus config scraping ``targets`` and loading the project's alert rules."""
    rules = DEPLOY / "prometheus" / "alerts.yml"
    return (
        f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
        f"rule_files: ['{rules}']\n"
        "scrape_configs:\n  - job_name: vllm-deltasync\n"
        f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
    )


def rank_status(rank: int, *, drafter: Any = None, **fields: Any) -> Any:
    """One rank's status as the engine core parses it (``server/messages.py``): the policy's
    ``fields``, and ``drafter`` (a ``rank_status`` of its own, or a dict of fields) as the
    drafter's."""
    from vllm_deltasync.server.messages import RankStatus, TargetStatus

    targets = {"policy": TargetStatus(rank=rank, model="policy", **fields)}
    if isinstance(drafter, RankStatus):
        import dataclasses

        targets["drafter"] = dataclasses.replace(drafter.targets["policy"], model="drafter")
    elif drafter is not None:
        targets["drafter"] = TargetStatus(**{"rank": rank, **drafter, "model": "drafter"})
    return RankStatus(targets, "policy")
