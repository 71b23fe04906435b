"""A real vLLM server with the extension, a trainer publishing AdamW steps, a real Prometheus.

One engine serves both exposure paths at once: the extension's own port (``metrics_port``) and
vLLM's ``/metrics`` through ``PROMETHEUS_MULTIPROC_DIR``. Assertions are PromQL queries.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.engines import api_server
from tests.helpers.monitoring import DEPLOY, parse_exposition, scrape_config
from tests.helpers.net import free_port, http_get

pytestmark = [pytest.mark.engine, pytest.mark.prometheus]
DELTAS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm", reason="the engine tests need vLLM (make setup)")
    from examples.toymodel import build_model

    return build_model(tmp_path_factory.mktemp("model") / "llama", family="llama")


class Trainer:
    """Real AdamW steps of the served model (fp32 master weights), published as bf16 deltas."""

    def __init__(self, model_dir: Path, url: str) -> None:
        from examples.toymodel import load_hf_model
        from vllm_deltasync.trainer.publisher import DeltaPublisher

        self.model = load_hf_model(model_dir, dtype=torch.float32).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.committed: list[Any] = []
        self.publisher = DeltaPublisher(url, anchor_every=100, on_commit=self.committed.append)
        self.step = 0
        torch.manual_seed(0)

    def publish(self) -> None:
        if self.step:
            ids = torch.randint(0, self.model.config.vocab_size, (2, 16))
            loss = self.model(input_ids=ids, labels=ids).loss
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        self.publisher.publish(self.step, dict(self.model.named_parameters()))
        self.publisher.flush()
        self.step += 1


@pytest.fixture
def server(tmp_path: Path, model_dir: Path) -> Iterator[dict[str, Any]]:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    trainer = Trainer(model_dir, url)
    trainer.publish()  # step 0: the anchor equal to the checkpoint the engine loads
    metrics_port = free_port()
    (tmp_path / "mp").mkdir()
    env = {"VLLM_DELTASYNC_URL": url, "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.5",
           "VLLM_DELTASYNC_METRICS_PORT": str(metrics_port),
           "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "mp")}
    try:
        with api_server(tmp_path, model_dir, env, max_model_len=256) as api:
            yield {"trainer": trainer, "api": api.url, "model": str(model_dir), "bucket": bucket,
                   "metrics": f"127.0.0.1:{metrics_port}", "log": api.log}
    finally:
        trainer.publisher.close()


def _payload_bytes(path: Path) -> int:
    """A safetensors file's size less its header (8 bytes of length, then the JSON)."""
    with path.open("rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header


def generate(api: str, model: str) -> None:
    """One short completion, so batches keep flowing while steps arrive."""
    import urllib.request

    body = json.dumps({"model": model, "prompt": "the policy", "max_tokens": 4}).encode()
    req = urllib.request.Request(api + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200 and json.loads(resp.read())["choices"]


def test_engine_metrics_follow_published_steps(server: dict[str, Any], prometheus_factory: Any) -> None:
    prom = prometheus_factory(scrape_config([server["metrics"]]))
    trainer = server["trainer"]
    prom.wait_for("count(deltasync_applied_step)", lambda v: v == 1, timeout=30)
    for _ in range(DELTAS):
        trainer.publish()
        generate(server["api"], server["model"])
        time.sleep(0.5)
    last = trainer.step - 1
    # the newest step gets applied, and staleness returns to zero once publishing stops (a
    # scrape can see steps_behind 0 before the rank discovered the last steps: wait for both)
    prom.wait_for("min(deltasync_applied_step)", lambda v: v == last, timeout=60)
    prom.wait_for("max(deltasync_steps_behind)", lambda v: v == 0, timeout=60)
    assert prom.value("max(deltasync_newest_step)") == last
    # the applied step moved while Prometheus watched (it started at the anchor, step 0)
    assert prom.value("min_over_time(min(deltasync_applied_step)[5m:1s])") <= 0
    # every delta byte the rank needs was downloaded exactly once (TP=1: one rank): each data
    # file but its safetensors header, which the manifest's byte ranges make unnecessary
    published = sum(_payload_bytes(server["bucket"] / f.path) for m in trainer.committed
                    if m.kind == "delta" for f in m.files)
    assert 0 < published < sum(m.totals.bytes for m in trainer.committed if m.kind == "delta")
    prom.wait_for('sum(deltasync_downloaded_bytes_total{kind="delta"})',
                  lambda v: v == published, timeout=10)
    assert prom.value("sum(deltasync_applied_steps_total)") >= DELTAS
    assert prom.value("sum(deltasync_pause_duration_seconds_count)") >= 1
    assert prom.value("max(deltasync_failing)") == 0
    seconds = prom.value("max(deltasync_newest_publish_timestamp_seconds"
                         " - deltasync_applied_publish_timestamp_seconds)")
    assert seconds == 0
    assert http_get(f"http://{server['metrics']}/synced")[0] == 200
    # the same series reach vLLM's own /metrics through PROMETHEUS_MULTIPROC_DIR
    code, body = http_get(f"{server['api']}/metrics")
    assert code == 200
    values = parse_exposition(body.decode())
    assert values[("deltasync_applied_step", (("model", "policy"), ("rank", "0")))] == last
    # and the dashboard's queries run without error on the engine's series
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "vllm-deltasync.json").read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "2m").replace('"$instance"', '".*"')
            assert prom.query(expr)["status"] == "success", expr
