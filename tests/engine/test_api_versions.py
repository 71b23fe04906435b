"""The reported step reaches HTTP clients: ``X-Weight-Version`` and ``weight_versions`` on
``/inference/v1/generate``, ``/v1/completions`` and ``/v1/chat/completions`` (through the
official ``openai`` client), and a request's demands (``X-Min-/X-Exact-Weight-Version``).

vLLM's token-in/token-out endpoint (``--enable-scale-out``, the one RL frameworks use) returns
per-token ``weight_versions`` spans; the coordinator sets vLLM's weight version to the step at
every switch. One real API server (TP=1) follows a ``file://`` bucket; every request's spans
must name exactly the steps applied, split where the switch happened, including a streaming
request that spans a switch. One server is shared by the tests of this module, in order; each
publishes the steps it needs after the previous test's.

Switches are placed deterministically, not by timing: with the test-only
failpoint ``switch_every_steps`` the coordinator switches only from a tick the engine runs
after every few model steps. A step staged while the server is idle therefore waits (the test
sees it staged, ``deltasync_staged_step``, and still not applied) and is switched to a few
tokens into the next request: the first tokens come from the old step, the rest from the new.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from examples.toymodel import build_model
from tests.helpers.engine_hooks import switch_every_steps_env
from tests.helpers.engines import ApiServer, Trainer, api_server, requires_vllm
from tests.helpers.net import free_port
from vllm_deltasync import DeltaPublisher

EVERY = 4  # model steps between switch ticks
MIN_WAIT_S = 2.0  # VLLM_DELTASYNC_MIN_VERSION_WAIT_S
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


@dataclass
class Served:
    server: ApiServer
    metrics: str
    trainer: Trainer
    pub: DeltaPublisher
    step: int = -1

    @property
    def api(self) -> str:
        return self.server.url

    def publish(self) -> int:
        """Publish the next step and wait until every rank staged it (not switched yet)."""
        if self.step >= 0:
            self.trainer.step()
        self.step += 1
        self.pub.publish(self.step, self.trainer.named_tensors())
        self.pub.flush()
        _wait_staged(self.metrics, self.step, self.server)
        return self.step


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp_path = tmp_path_factory.mktemp("api_versions")
    model_dir = build_model(tmp_path / "model", "qwen2", seed=11)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    url = f"file://{tmp_path}/bucket"
    port = free_port()
    env = {"VLLM_DELTASYNC_URL": url, "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
           "VLLM_DELTASYNC_METRICS_PORT": str(port), "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1",
           "VLLM_DELTASYNC_MIN_VERSION_WAIT_S": str(MIN_WAIT_S),
           **switch_every_steps_env(EVERY)}
    with DeltaPublisher(url, anchor_every=10) as pub:
        served = Served(None, f"http://127.0.0.1:{port}",  # type: ignore[arg-type]
                        Trainer(model_dir, lr=1e-5, seed=11), pub)
        served.step = 0
        pub.publish(0, served.trainer.named_tensors())
        pub.flush()
        with api_server(tmp_path, model_dir, env,
                        extra_args=("--enable-scale-out", "--chat-template", str(template))
                        ) as server:
            served.server = server
            _wait_staged(served.metrics, 0, server)
            yield served


@requires_vllm
@pytest.mark.engine
def test_generate_endpoint_weight_versions_follow_the_switches(served: Served) -> None:
    api, metrics = served.api, served.metrics
    assert _applied(metrics) == [None]  # staged, not switched: no model step yet
    _, first = _generate(api, stream=False)
    assert _spans(first)[-1][0] == "0" and _spans(first)[-1][2] == TOKENS, first
    assert _applied(metrics) == [0]

    # a streaming request spans the switch to step 1
    served.publish()
    assert _applied(metrics) == [0]
    streamed, spans = _generate(api, stream=True)
    assert len(streamed) == TOKENS
    _split(_spans(spans), 0, 1)
    assert _applied(metrics) == [1]

    # a plain request spans the switch to step 2
    served.publish()
    assert _applied(metrics) == [1]
    _, spans = _generate(api, stream=False)
    _split(_spans(spans), 1, 2)

    # nothing staged: the whole output comes from step 2, streamed or not
    plain_tokens, plain = _generate(api, stream=False)
    stream_tokens, streamed_spans = _generate(api, stream=True)
    assert _spans(plain) == _spans(streamed_spans) == [("2", 0, TOKENS)]
    assert plain_tokens == stream_tokens  # greedy, same weights, same answer
    assert _applied(metrics) == [2]
    assert _metric(metrics, "deltasync_switches_total") == [3.0]


def _client(served: Served, **headers: str) -> Any:
    import openai

    return openai.OpenAI(base_url=served.api + "/v1", api_key="unused", max_retries=0,
                         default_headers=headers or None, timeout=120)


def _top(obj: Any) -> list[tuple[str, int, int]]:
    """The top-level ``weight_versions`` the openai client kept (one choice: index 0)."""
    spans = obj.model_extra["weight_versions"]
    assert spans == obj.weight_versions, "attribute access and model_extra agree"
    assert all(s["index"] == 0 for s in spans), spans
    # a choice a switch crossed says what its sequence did there (the default mode), no other
    crossed = len({s["version"] for s in spans}) > 1
    assert (obj.choices[0].model_extra or {}).get("in_flight") == ("keep_kv" if crossed else None)
    return [(s["version"], s["start"], s["end"]) for s in spans]


def _complete(served: Served, *, stream: bool, chat: bool,
              **headers: str) -> tuple[str, list[tuple[str, int, int]]]:
    """Greedy ``TOKENS`` tokens through the openai client: the X-Weight-Version header and the
    top-level spans (a stream: of its final chunk; the chunks before it carry none)."""
    client = _client(served, **headers)
    common: dict[str, Any] = {"model": client.models.list().data[0].id, "max_tokens": TOKENS,
                              "temperature": 0, "extra_body": {"ignore_eos": True}}
    if chat:
        make = client.chat.completions.with_raw_response.create
        common["messages"] = [{"role": "user", "content": "the weights moved"}]
    else:
        make = client.completions.with_raw_response.create
        common["prompt"] = PROMPT
    raw = make(stream=stream, **common)
    header = raw.headers["X-Weight-Version"]
    if not stream:
        return header, _top(raw.parse())
    finals = []
    chunks = 0
    for chunk in raw.parse():
        chunks += 1
        if chunk.model_extra.get("weight_versions"):
            finals.append(chunk)
    assert chunks > 2, "the response was not streamed"
    assert len(finals) == 1, "exactly the chunk finishing the choice carries the spans"
    assert finals[0].choices and finals[0].choices[0].finish_reason is not None
    return header, _top(finals[0])


@requires_vllm
@pytest.mark.engine
def test_openai_client_reads_the_version_of_every_response(served: Served) -> None:
    """Completions and chat completions, streamed and not, through the official client: the
    header and the top-level spans name the steps applied, across a switch too."""
    s = served.publish()  # staged; switched to a few tokens into the next request
    header, spans = _complete(served, stream=False, chat=False)
    assert header == f"{s - 1}-{s}"
    _split(spans, s - 1, s)
    header, spans = _complete(served, stream=True, chat=False)
    assert (header, spans) == (str(s), [(str(s), 0, TOKENS)])

    s = served.publish()
    header, spans = _complete(served, stream=False, chat=True)
    assert header == f"{s - 1}-{s}"
    _split(spans, s - 1, s)
    header, spans = _complete(served, stream=True, chat=True)
    assert (header, spans) == (str(s), [(str(s), 0, TOKENS)])

    # a stream spanning a switch: its headers leave with the first chunk, so the header names
    # the steps of the tokens made by then (the first ones came from the old step); the final
    # chunk's spans name every token's
    s = served.publish()
    header, spans = _complete(served, stream=True, chat=False)
    _split(spans, s - 1, s)
    assert header in (str(s - 1), f"{s - 1}-{s}"), header
    header, spans = _complete(served, stream=False, chat=False)
    assert (header, spans) == (str(s), [(str(s), 0, TOKENS)])


def _refusal(call: Callable[[], Any]) -> Any:
    import openai

    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


@requires_vllm
@pytest.mark.engine
def test_requests_demand_a_version(served: Served) -> None:
    """``X-Min-Weight-Version`` waits then serves, or times out into 409 with Retry-After;
    ``X-Exact-Weight-Version`` is served on that step or answered 409; bad values get 400.
    Every 409 is counted by reason on the engine core's /metrics, and every request added to
    the engine is in the steps-behind histogram."""
    import openai

    now = served.step
    before = _metric(served.metrics, "deltasync_admission_steps_behind_count")
    header, spans = _complete(served, stream=False, chat=False, **{"X-Min-Weight-Version": str(now)})
    assert (header, spans) == (str(now), [(str(now), 0, TOKENS)])

    # nothing newer is published: the wait times out into 409
    started = time.monotonic()
    err = _refusal(lambda: _complete(served, stream=False, chat=False,
                                     **{"X-Min-Weight-Version": str(now + 1)}))
    waited = time.monotonic() - started
    assert isinstance(err, openai.ConflictError) and err.status_code == 409
    assert waited >= MIN_WAIT_S * 0.9, waited
    assert err.response.headers["Retry-After"] == str(math.ceil(MIN_WAIT_S))
    body = err.body
    assert isinstance(body, dict), body
    error = body.get("error", body)
    assert (error["current_step"], error["required_step"], error["reason"]) == (
        now, now + 1, "min_timeout"), body

    # step now+1 is published while a request waits for it; a plain request drives the model
    # steps whose tick switches to it; the waiting request is then served from it
    nxt = served.publish()
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(_complete, served, stream=False, chat=False,
                              **{"X-Min-Weight-Version": str(nxt)})
        time.sleep(0.3)
        pool.submit(_complete, served, stream=False, chat=False).result()
        header, spans = waiting.result()
    assert (header, spans) == (str(nxt), [(str(nxt), 0, TOKENS)])

    # exact: served on the applied step; 409 for a newer (retry later) or an older one (never)
    header, spans = _complete(served, stream=True, chat=True,
                              **{"X-Exact-Weight-Version": str(nxt)})
    assert (header, spans) == (str(nxt), [(str(nxt), 0, TOKENS)])
    ahead = _refusal(lambda: _complete(served, stream=False, chat=False,
                                       **{"X-Exact-Weight-Version": str(nxt + 3)}))
    assert ahead.status_code == 409 and ahead.response.headers["Retry-After"] == "1"
    passed = _refusal(lambda: _complete(served, stream=False, chat=True,
                                        **{"X-Exact-Weight-Version": str(nxt - 1)}))
    assert passed.status_code == 409 and "Retry-After" not in passed.response.headers
    assert "never serves it again" in str(passed.message) or "never" in json.dumps(passed.body)

    # exact, and a switch lands inside the request: 409, its tokens dropped
    last = served.publish()
    crossed = _refusal(lambda: _complete(served, stream=False, chat=False,
                                         **{"X-Exact-Weight-Version": str(last - 1)}))
    assert crossed.status_code == 409 and crossed.response.headers["X-Weight-Version"] == str(last)

    # bad values: 400, one line
    for bad in ("abc", "-1", "1.5", "99999999999999999999", ""):
        resp = _raw_post(served.api + "/v1/completions", {"X-Min-Weight-Version": bad})
        assert resp[0] == 400, (bad, resp)
        assert "\n" not in resp[1]["error"]["message"], resp
    both = _raw_post(served.api + "/v1/completions", {"X-Min-Weight-Version": "1",
                                                      "X-Exact-Weight-Version": "1"})
    assert both[0] == 400

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        conflicts = {r: _series(served.metrics,
                                f'deltasync_version_conflicts_total{{reason="{r}"}}')
                     for r in ("min_timeout", "exact_behind", "exact_passed", "exact_switched")}
        if all(v == [1.0] for v in conflicts.values()):
            break
        time.sleep(0.2)
    assert all(v == [1.0] for v in conflicts.values()), conflicts
    after = _metric(served.metrics, "deltasync_admission_steps_behind_count")
    assert after[0] >= before[0] + 5, (before, after)


def _series(metrics: str, series: str) -> list[float]:
    """The values of one exact series (name and labels) on /metrics."""
    with urllib.request.urlopen(metrics + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith(series + " ")]


def _raw_post(url: str, headers: dict[str, str]) -> tuple[int, Any]:
    body = {"model": "x", "prompt": PROMPT, "max_tokens": 1}
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
