"""The real OpenAI-compatible server, configured only by --worker-extension-cls and env vars.

Nothing else is done by the test: no collective_rpc, no dev-mode routes. The server must
notice each published step and switch; ``/synced`` on the engine's metrics port says which
step every rank runs, and completions keep being served.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model
from tests.helpers.engines import ApiServer, Trainer, api_server, complete, get_json, requires_vllm
from tests.helpers.net import free_port
from vllm_deltasync import DeltaPublisher


def _wait_synced(metrics: str, step: int, server: ApiServer) -> dict[str, Any]:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail("server exited:\n" + server.log_tail())
        try:
            code, body = get_json(metrics + "/synced")
            if code == 200 and all(r["applied_step"] == step for r in body["ranks"]):
                return body
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"step {step} never synced:\n" + server.log_tail())


@requires_vllm
@pytest.mark.engine
def test_openai_server_follows_bucket_with_env_only(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "model", "qwen2", seed=7)
    trainer = Trainer(model_dir, lr=1e-5, seed=7)
    url = f"file://{tmp_path}/bucket"
    metrics_port = free_port()
    env = {"VLLM_DELTASYNC_URL": url, "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
           "VLLM_DELTASYNC_METRICS_PORT": str(metrics_port),
           "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1"}
    metrics = f"http://127.0.0.1:{metrics_port}"
    with DeltaPublisher(url, anchor_every=3) as pub:
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        with api_server(tmp_path, model_dir, env) as server:
            _wait_synced(metrics, 0, server)
            first = complete(server.url, str(model_dir))
            for step in range(1, 5):
                trainer.step()
                pub.publish(step, trainer.named_tensors())
                pub.flush()
                body = _wait_synced(metrics, step, server)
                assert body["ranks"][0]["last_error"] is None
                assert complete(server.url, str(model_dir))["choices"][0]["text"] is not None
            with urllib.request.urlopen(metrics + "/metrics", timeout=5) as resp:
                text = resp.read().decode()
    assert first["choices"]
    applied = [ln for ln in text.splitlines() if ln.startswith("deltasync_applied_step{")]
    assert applied and all(ln.endswith(" 4.0") for ln in applied), applied
