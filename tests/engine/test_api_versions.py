"""The reported step reaches HTTP clients: ``weight_versions`` on ``/inference/v1/generate``.

vLLM's token-in/token-out endpoint (``--enable-scale-out``, the one RL frameworks use) returns
per-token ``weight_versions`` spans; the coordinator sets vLLM's weight version to the step at
every switch. One real API server (TP=1) follows a ``file://`` bucket; every request's spans
must name exactly the steps applied, split where the switch happened, including a streaming
request that spans a switch.

Switches are placed deterministically, not by timing: with the test-only
``DELTASYNC_TEST_SWITCH_EVERY_STEPS`` the coordinator switches only from a tick the engine runs
after every few model steps. A step staged while the server is idle therefore waits (the test
sees it staged, ``deltasync_staged_step``, and still not applied) and is switched to a few
tokens into the next request: the first tokens come from the old step, the rest from the new.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model
from vllm_deltasync import DeltaPublisher

from .conftest import ApiServer, Trainer, api_server, free_port, requires_vllm
from .engine_hooks import switch_every_steps_env

EVERY = 4  # model steps between switch ticks
TOKENS = 24
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120)


def _generate(api: str, *, stream: bool) -> tuple[list[int], list[dict[str, Any]]]:
    """Greedy ``TOKENS`` tokens; the output token ids and the choice's weight-version spans
    (for a stream: every chunk's tokens, the spans of the final chunk)."""
    body = {"token_ids": PROMPT, "stream": stream,
            "sampling_params": {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}}
    with _post(api + "/inference/v1/generate", body) as resp:
        if not stream:
            choice = json.loads(resp.read())["choices"][0]
            return choice["token_ids"], choice["weight_versions"]
        tokens: list[int] = []
        spans: list[dict[str, Any]] = []
        chunks = 0
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data:"):])["choices"][0]
            chunks += 1
            tokens += choice.get("token_ids") or []
            if choice.get("weight_versions"):
                spans = choice["weight_versions"]
        assert chunks > 1, "the response was not streamed"
        return tokens, spans


def _metric(metrics: str, name: str) -> list[float]:
    with urllib.request.urlopen(metrics + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith((name + "{", name + " "))]


def _applied(metrics: str) -> list[int | None]:
    try:
        with urllib.request.urlopen(metrics + "/synced", timeout=5) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as err:
        body = json.loads(err.read())
    return [r["applied_step"] for r in body["ranks"]]


def _wait_staged(metrics: str, step: int, server: ApiServer) -> None:
    """Until every rank has ``step`` staged (downloaded, verified, ready to apply)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail("server exited:\n" + server.log_tail())
        try:
            staged = _metric(metrics, "deltasync_staged_step")
            if staged and all(s == step for s in staged):
                return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"step {step} never staged:\n" + server.log_tail())


def _spans(spans: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    return [(s["version"], s["start"], s["end"]) for s in spans]


def _split(spans: list[tuple[str, int, int]], old: int, new: int) -> int:
    """The spans are ``old`` then ``new`` over all TOKENS tokens; the token index of the
    switch."""
    assert len(spans) == 2, spans
    (v0, s0, e0), (v1, s1, e1) = spans
    assert (v0, v1) == (str(old), str(new)), spans
    assert s0 == 0 and e0 == s1 and e1 == TOKENS and 0 < e0 < TOKENS, spans
    return e0


@requires_vllm
@pytest.mark.engine
def test_generate_endpoint_weight_versions_follow_the_switches(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "model", "qwen2", seed=11)
    trainer = Trainer(model_dir, lr=1e-5, seed=11)
    url = f"file://{tmp_path}/bucket"
    port = free_port()
    metrics = f"http://127.0.0.1:{port}"
    env = {"VLLM_DELTASYNC_URL": url, "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
           "VLLM_DELTASYNC_METRICS_PORT": str(port), "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1",
           **switch_every_steps_env(EVERY)}
    with DeltaPublisher(url, anchor_every=10) as pub:
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        with api_server(tmp_path, model_dir, env, extra_args=("--enable-scale-out",)) as server:
            api = server.url
            _wait_staged(metrics, 0, server)
            assert _applied(metrics) == [None]  # staged, not switched: no model step yet
            _, first = _generate(api, stream=False)
            assert _spans(first)[-1][0] == "0" and _spans(first)[-1][2] == TOKENS, first
            assert _applied(metrics) == [0]

            # a streaming request spans the switch to step 1
            trainer.step()
            pub.publish(1, trainer.named_tensors())
            pub.flush()
            _wait_staged(metrics, 1, server)
            assert _applied(metrics) == [0]
            streamed, spans = _generate(api, stream=True)
            assert len(streamed) == TOKENS
            _split(_spans(spans), 0, 1)
            assert _applied(metrics) == [1]

            # a plain request spans the switch to step 2
            trainer.step()
            pub.publish(2, trainer.named_tensors())
            pub.flush()
            _wait_staged(metrics, 2, server)
            assert _applied(metrics) == [1]
            _, spans = _generate(api, stream=False)
            _split(_spans(spans), 1, 2)

            # nothing staged: the whole output comes from step 2, streamed or not
            plain_tokens, plain = _generate(api, stream=False)
            stream_tokens, streamed_spans = _generate(api, stream=True)
            assert _spans(plain) == _spans(streamed_spans) == [("2", 0, TOKENS)]
            assert plain_tokens == stream_tokens  # greedy, same weights, same answer
            assert _applied(metrics) == [2]
            switches = _metric(metrics, "deltasync_switches_total")
    assert switches == [3.0], switches
