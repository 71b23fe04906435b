"""Data parallel: each engine core follows by itself; MoE at DP > 1 is refused.

vLLM runs one engine core per data-parallel rank. For a dense model each is a plain
``EngineCoreProc`` (vLLM treats dense DP ranks as independent engines): each starts its own
coordinator, switches between its own batches, and serves ``/metrics`` and ``/synced`` on
``metrics_port + DP rank``. For a MoE model vLLM runs ``DPEngineCoreProc``, whose experts are
sharded across the engines of all DP ranks; those refuse to follow (no rank starts), with the
reason on ``/synced`` (503) and in the log. The refusal is tested without an engine (a MoE
engine at DP=2 would add minutes); the dense case runs the real API server at DP=2.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from examples.toymodel import build_model
from tests.helpers.engines import EXTENSION, ApiServer, Trainer, api_server, get_json, requires_vllm
from tests.helpers.net import free_port
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.config import SyncConfig


def _vllm_config(*, moe: bool, dp: int, index: int, url: str, port: int) -> Any:
    return SimpleNamespace(
        additional_config={"deltasync": {"url": url, "metrics_port": port,
                                         "metrics_host": "127.0.0.1"}},
        parallel_config=SimpleNamespace(data_parallel_size=dp, data_parallel_index=index,
                                        worker_extension_cls=EXTENSION,
                                        tensor_parallel_size=1),
        model_config=SimpleNamespace(is_moe=moe),
    )


def _unsupported_layout(vllm_config: Any) -> str | None:
    from vllm_deltasync.server.engine.admission import unsupported_layout
    from vllm_deltasync.server.vllm.engine import facts_of

    return unsupported_layout(facts_of(vllm_config))


def test_refused_layouts() -> None:
    reason = _unsupported_layout(_vllm_config(moe=True, dp=2, index=0, url="file:///b", port=0))
    assert reason is not None and "--data-parallel-size" in reason and "MoE" in reason
    assert _unsupported_layout(_vllm_config(moe=True, dp=1, index=0, url="file:///b", port=0)) is None
    assert _unsupported_layout(_vllm_config(moe=False, dp=2, index=1, url="file:///b", port=0)) is None
    spmd = _vllm_config(moe=False, dp=1, index=0, url="file:///b", port=0)
    spmd.parallel_config.distributed_executor_backend = "external_launcher"
    assert _unsupported_layout(spmd) is None  # one rank per model: an independent engine
    spmd.parallel_config.tensor_parallel_size = 2
    assert "external_launcher" in (_unsupported_layout(spmd) or "")


def test_metrics_port_is_offset_by_the_data_parallel_rank() -> None:
    from vllm_deltasync.server.engine.admission import engine_config

    config = SyncConfig(url="file:///b", metrics_port=9464)
    for index, port in ((0, 9464), (1, 9465), (3, 9467)):
        assert engine_config(config, index).metrics_port == port
    off = SyncConfig(url="file:///b", metrics_port=0)
    assert engine_config(off, 1) is off


@requires_vllm
def test_moe_engine_core_at_data_parallel_refuses_without_starting_a_rank(tmp_path: Path) -> None:
    """What the plugin does in a MoE engine core of DP rank 1 of 2: the coordinator starts
    only to refuse; no rank is started or proved, /synced (on port + 1) answers 503 with the
    reason, and ticks do nothing."""
    from vllm_deltasync.server.vllm.engine import start_coordinator as _start_coordinator

    port = free_port(2)
    calls: list[str] = []

    class Engine:  # the part of vLLM's EngineCore the coordinator calls
        vllm_config = _vllm_config(moe=True, dp=2, index=1, url=f"file://{tmp_path}/b", port=port)

        def collective_rpc(self, method: str, timeout: float | None = None,  # vLLM's signature
                           args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
            calls.append(method)
            return [None]  # a worker where deltasync never started answers deltasync_stop so

        def get_weight_version(self) -> str:
            return "0"

    coord = _start_coordinator(Engine())
    try:
        assert calls == ["deltasync_stop"]
        assert not coord.active and "data parallel size 2" in coord.last_error
        coord.tick()
        assert calls == ["deltasync_stop"]
        code, body = get_json(f"http://127.0.0.1:{port + 1}/synced")
        assert code == 503 and not body["synced"]
        assert "--data-parallel-size" in body["coordinator"]["last_error"]
        assert "MoE" in body["ranks"][0]["last_error"]
    finally:
        coord.close()


# -- the real API server at --data-parallel-size 2 ---------------------------------------------


def _wait_synced(metrics: list[str], step: int, server: ApiServer) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail("server exited:\n" + server.log_tail())
        bodies = []
        for m in metrics:
            try:
                code, body = get_json(m + "/synced")
            except OSError:
                break
            if code != 200 or any(r["applied_step"] != step for r in body["ranks"]):
                break
            bodies.append(body)
        if len(bodies) == len(metrics):
            return bodies
        time.sleep(0.5)
    pytest.fail(f"step {step} never synced on every engine:\n" + server.log_tail())


def _generate(api: str) -> tuple[list[int], list[dict[str, Any]]]:
    body = {"token_ids": [5, 17, 42, 99, 7, 3, 250, 11], "stream": False,
            "sampling_params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(api + "/inference/v1/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        choice = json.loads(resp.read())["choices"][0]
    return choice["token_ids"], choice["weight_versions"]


@requires_vllm
@pytest.mark.engine
def test_api_server_at_data_parallel_2_follows_on_every_engine(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "model", "qwen2", seed=8)
    trainer = Trainer(model_dir, lr=1e-5, seed=8)
    url = f"file://{tmp_path}/bucket"
    port = free_port(2)
    env = {"VLLM_DELTASYNC_URL": url, "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
           "VLLM_DELTASYNC_METRICS_PORT": str(port),
           "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1"}
    metrics = [f"http://127.0.0.1:{port + i}" for i in range(2)]
    with DeltaPublisher(url, anchor_every=5) as pub:
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        with api_server(tmp_path, model_dir, env,
                        extra_args=("--data-parallel-size", "2", "--enable-scale-out")) as server:
            _wait_synced(metrics, 0, server)
            for step in (1, 2):
                trainer.step()
                pub.publish(step, trainer.named_tensors())
                pub.flush()
                bodies = _wait_synced(metrics, step, server)
                assert all(r["last_error"] is None for b in bodies for r in b["ranks"]), bodies
                for _ in range(4):  # spread over both engines by vLLM's DP load balancer
                    tokens, spans = _generate(server.url)
                    assert tokens
                    assert {s["version"] for s in spans} == {str(step)}, spans
            log = server.log.read_text(errors="replace")
    assert "metrics endpoint not started" not in log
