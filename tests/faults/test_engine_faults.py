"""Fault matrix, engine rows (item 10). One TP=1 vLLM engine (module scope) follows an hf://
bucket on the local Hub server; the rows run in order on it, time compressed through config
(poll interval 0.2 s, a fast retry policy in ``store_options``), never long sleeps:

1. the bucket unreachable (every API and resolve request answers 503) for 20 poll intervals:
   the engine keeps serving, the failed requests are counted, and it catches up by itself;
2. an anchor failing half-way on the engine (test failpoint: rank 0 raises after writing two
   pieces of anchor 3): half an anchor cannot be taken back, so this is the hold path:
   scheduling is held and the weight version is "inconsistent" until an anchor applies whole
   (anchor 3 again: it covers every element), then the engine goes on to step 4 (digests equal
   that checkpoint, serving again); no delta is ever applied on the half-written weights;
3. the trainer restarted from an earlier checkpoint with a new run id: it publishes after the
   newest committed step (names are immutable), its first step is an anchor, the engine
   follows the new run from that anchor and never applies a delta of one run on the other;
4. the API server killed with SIGKILL while following and started again: it catches up
   through an anchor and never applies a partial step (digests equal the newest checkpoint).

Run through the engine lock:
``flock /tmp/engine.lock .venv/bin/python -m pytest -q -p no:cacheprovider tests/faults/test_engine_faults.py``
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import hubserver
from tests.helpers.cores import other_core
from tests.helpers.engines import (
    Trainer,
    api_server,
    close_llm,
    digests_equal_checkpoint,
    engine_env,
    engine_status,
    generate,
    long_prompts,
    make_llm,
    requires_vllm,
    wait_applied,
)
from tests.helpers.faults import assert_no_secret
from tests.helpers.net import free_port
from tests.helpers.transports import local_uploader
from vllm_deltasync import DeltaPublisher, failpoints

pytestmark = [requires_vllm, pytest.mark.engine]

FAST_RETRY = {"attempts": 2, "base_delay_s": 0.05, "max_delay_s": 0.2}


class Run:
    """The module's trainer, publisher, bucket and engine."""

    def __init__(self, tmp: Path, hub: Any) -> None:
        from examples.toymodel import build_model

        self.tmp, self.hub = tmp, hub
        self.bucket_id = f"tester/faults-{uuid.uuid4().hex[:8]}"
        hub.create_bucket(self.bucket_id)
        self.url = f"hf://buckets/{self.bucket_id}/run"
        self.options = {"endpoint": hub.endpoint, "token": hub.token, "environ": {},
                        "uploader": local_uploader(hub, self.bucket_id), "part_size": 1 << 16}
        self.model_dir = build_model(tmp / "model", "llama", seed=31)
        self.trainer = Trainer(self.model_dir, lr=1e-5, seed=31)
        self.pub = DeltaPublisher(self.url, anchor_every=3, keep_anchors=3,
                                  run_id="00000000000000a1", store_options=self.options)
        self.env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token}
        self.llm: Any = None

    def publish(self, step: int, train: bool = True) -> Path:
        if train:
            self.trainer.step()
        self.pub.publish(step, self.trainer.named_tensors())
        self.pub.flush()
        return self.trainer.save(self.tmp / f"ckpt-{step}")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, hub_server: Any) -> Iterator[Run]:
    hub_server.faults = hubserver.Faults(events_max_s=1.0)  # feeds reconnect every second
    tmp = tmp_path_factory.mktemp("faults-engine")
    state = Run(tmp, hub_server)
    state.publish(0, train=False)
    with engine_env(tmp, 1, {**state.env, **failpoints.env(failpoints.spec("apply", "policy", 0, 3, 2))}, url=state.url,
                    poll_interval_s=0.2, metrics_port=0,
                    store_options=json.dumps({"retry_policy": FAST_RETRY})):
        state.llm = make_llm(state.model_dir, 1, extension=True)
        try:
            wait_applied(state.llm, 0, timeout_s=120)
            yield state
        finally:
            hub_server.faults = hubserver.Faults()
            close_llm(state.llm)
            state.pub.close()


def test_bucket_unreachable_for_minutes_keeps_serving_and_recovers(run: Run) -> None:
    ckpt1 = run.publish(1)
    wait_applied(run.llm, 1)
    prompts = long_prompts(2, seed=31)
    before = generate(run.llm, prompts)
    run.hub.faults.fail_status, run.hub.faults.fail_next = 503, 10**9
    try:
        time.sleep(4.0)  # 20 poll intervals without a bucket ("minutes", compressed)
        during = generate(run.llm, prompts)  # serving goes on, on step 1
        status = run.llm.collective_rpc("deltasync_status")[0]
    finally:
        run.hub.faults.fail_next = 0
    assert [o["tokens"] for o in during] == [o["tokens"] for o in before]
    assert status["applied_step"] == 1 and digests_equal_checkpoint(run.llm, ckpt1)
    errors = [n for op, outcome, n in status["counters"]["store_requests"] if outcome == "error"]
    assert errors and sum(errors) > 0  # counted (op, outcome labels: a fixed set)
    ckpt2 = run.publish(2)  # the bucket is back: the engine catches up by itself
    wait_applied(run.llm, 2, timeout_s=60)
    assert digests_equal_checkpoint(run.llm, ckpt2)
    assert_no_secret(json.dumps(status, default=str))
    assert run.hub.token not in json.dumps(status, default=str)


def test_anchor_failing_half_way_holds_then_resyncs(run: Run) -> None:
    run.publish(3)  # anchor: the failpoint stops rank 0 after two pieces
    deadline = time.monotonic() + 60
    while (info := engine_status(run.llm))["weight_version"] != "inconsistent":
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
    assert "failpoint" in str(info["last_error"])  # held: half an anchor cannot be taken back
    failed_at = len(info["switches"])
    ckpt4 = run.publish(4)
    wait_applied(run.llm, 4, timeout_s=60)
    # resynced through an anchor (3 again, whole this time: it covers every element), never by
    # a delta on the half-written weights
    after = engine_status(run.llm)
    assert any("anchor" in (s.get("kinds") or []) for s in after["switches"][failed_at:])
    assert digests_equal_checkpoint(run.llm, ckpt4)
    assert after["weight_version"] == "4"
    assert generate(run.llm, long_prompts(1, seed=3))  # scheduling is no longer held


def test_trainer_restarted_from_an_earlier_step_with_a_new_run(run: Run) -> None:
    """Run a dies; run b restarts from the step-2 weights of run a (an earlier checkpoint)."""
    restarted = Trainer(run.tmp / "ckpt-2", lr=1e-5, seed=77)
    run.pub.close()
    run.pub = DeltaPublisher(run.url, anchor_every=3, keep_anchors=3, run_id="00000000000000b2",
                             store_options=run.options)
    run.trainer = restarted
    ckpt5 = run.publish(5)  # after the newest committed step; the first step of a run: anchor
    wait_applied(run.llm, 5, timeout_s=60)
    assert digests_equal_checkpoint(run.llm, ckpt5)
    ckpt6 = run.publish(6)
    wait_applied(run.llm, 6, timeout_s=60)
    assert digests_equal_checkpoint(run.llm, ckpt6)
    switches = engine_status(run.llm)["switches"]
    assert switches[-2]["kinds"] == ["anchor"]  # entered run b through its anchor


def test_idle_follower_leaves_the_cores_alone(run: Run) -> None:
    """Synced and idle, the coordinator still reads every rank's status each poll interval
    (0.2 s here). vLLM's worker spins for a second after each message it reads, so those
    reads alone used to hold the worker's main thread (the one serving RPCs) at ~100% of a
    core on every rank for as long as the server was idle, starving other processes on the
    node. Now that thread must stay well under a tenth of a core. (The worker's poller
    thread, polling the Hub five times a second here, is not what is measured.)"""
    import psutil

    wait_applied(run.llm, 6, timeout_s=60)
    workers = [p for p in psutil.Process().children(recursive=True)
               if p.name().startswith("VLLM::Worker") or "Worker" in " ".join(p.cmdline())]
    assert workers, "no worker process found under the test process"

    def main_thread_cpu(proc: Any) -> float:
        return next(t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid)

    time.sleep(1.5)  # vLLM's own one-second spin after the last other RPC (digests) passes
    before = {p.pid: main_thread_cpu(p) for p in workers}
    t0 = time.monotonic()
    time.sleep(4.0)  # twenty ticks of the coordinator
    wall = time.monotonic() - t0
    used = {p.pid: (main_thread_cpu(p) - before[p.pid]) / wall for p in workers}
    assert all(u < 0.1 for u in used.values()), f"worker main threads' share of a core: {used}"


def test_api_server_killed_and_restarted_catches_up(run: Run) -> None:
    port = free_port()
    env = {**run.env, "VLLM_CPU_OMP_THREADS_BIND": other_core(),  # not the module engine's core
           "VLLM_DELTASYNC_URL": run.url, "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
           "VLLM_DELTASYNC_METRICS_PORT": str(port), "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1",
           "VLLM_DELTASYNC_STORE_OPTIONS": json.dumps({"retry_policy": FAST_RETRY})}
    metrics = f"http://127.0.0.1:{port}"
    for folder in ("srv1", "srv2"):
        (run.tmp / folder).mkdir()
    with api_server(run.tmp / "srv1", run.model_dir, env) as server:
        _wait_synced(metrics, 6, server)
        run.publish(7)
        time.sleep(0.3)  # while it follows step 7: mid-download or staged at worst
        os.killpg(server.proc.pid, signal.SIGKILL)  # the server and its engine processes
        server.proc.wait()
    run.publish(8)  # an anchor (every 3rd step of run b)
    with api_server(run.tmp / "srv2", run.model_dir, env) as server:
        body = _wait_synced(metrics, 8, server)
        assert all(r["last_error"] is None for r in body["ranks"])
        with urllib.request.urlopen(metrics + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    # the fresh process loaded the original checkpoint: it reached 8 through an anchor
    applied = [ln for ln in text.splitlines() if ln.startswith("deltasync_applied_step{")]
    assert applied and all(ln.endswith(" 8.0") for ln in applied), applied
    assert_no_secret(json.dumps(body), text)
    assert run.hub.token not in json.dumps(body) + text + server.log_tail()


def _wait_synced(metrics: str, step: int, server: Any, timeout_s: float = 240.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail("server exited:\n" + server.log_tail())
        try:
            with urllib.request.urlopen(metrics + "/synced", timeout=5) as resp:
                body = json.loads(resp.read())
            if all(r["applied_step"] == step for r in body["ranks"]):
                return dict(body)
        except OSError:
            pass
        time.sleep(0.3)
    pytest.fail(f"step {step} never synced:\n" + server.log_tail())
