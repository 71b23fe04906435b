"""The API server's resolution of followed LoRA adapters without an engine: ``<name>`` and
``<name>@<step>``, the 404 naming the kept versions, the data-parallel choice, the version
headers applied to the adapter, and the middleware that answers before vLLM (the engine tests
are tests/engine/test_lora_adapter.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest

from vllm_deltasync.server.api.adapters import (
    MARKER,
    Adapters,
    marker_id,
    not_kept,
    parse_model,
    version_path,
)
from vllm_deltasync.server.api.middleware import VersionMiddleware
from vllm_deltasync.server.api.versions import CALLS, Calls, admit_adapter
from vllm_deltasync.server.targets import ADAPTER_IDS, adapter_id


def _report(**adapters: Sequence[int]) -> dict[str, Any]:
    """An engine's ``deltasync_lora_versions`` answer with these steps of each adapter."""
    return {name: {"versions": [[s, adapter_id(name, s, f"sha256:{s:064d}"), f"sha256:{s:064d}"]
                                for s in steps], "retiring": [], "refused": None, "error": None}
            for name, steps in adapters.items()}


def test_models_are_parsed_for_followed_names_only() -> None:
    names = ("math", "code-v1.2")
    assert parse_model("math", names) == ("math", None)
    assert parse_model("math@12", names) == ("math", 12)
    assert parse_model("code-v1.2@0", names) == ("code-v1.2", 0)
    for other in ("base", "other@3", "math@", "math@-1", "math@1@2", "math@x", None, 7,
                  "math@" + "9" * 14):
        assert parse_model(other, names) is None, other


def test_the_newest_version_and_exact_steps_are_chosen() -> None:
    adapters = Adapters(["math", "code"])
    adapters.update([_report(math=[4, 5], code=[1])])
    newest = adapters.choose("math", None)
    assert newest is not None and (newest.step, newest.engine, newest.model) == (5, None, "math@5")
    assert newest.adapter == adapter_id("math", 5, newest.identity)
    assert newest.path.startswith(MARKER + "math@5/")
    assert adapters.choose("math", 4).step == 4  # type: ignore[union-attr]
    assert adapters.choose("math", 3) is None and adapters.choose("code", 2) is None
    assert adapters.steps("math") == [4, 5] and adapters.newest("code") == 1
    body = not_kept(adapters, "math", 3)
    assert body["error"]["code"] == 404 and body["error"]["kept_steps"] == [4, 5]
    assert "math@4, math@5" in body["error"]["message"]


def test_data_parallel_engines_each_report_and_the_choice_routes() -> None:
    """The newest step any engine applied; when not every engine keeps it, the request goes
    to one that does (in turn among them); a step every engine keeps goes anywhere."""
    adapters = Adapters(["math"])
    adapters.update([_report(math=[4, 5]), _report(math=[3, 4]), _report(math=[5])])
    newest = adapters.choose("math", None)
    assert newest is not None and newest.step == 5 and newest.engine in (0, 2)
    engines = {adapters.choose("math", 5).engine for _ in range(4)}  # type: ignore[union-attr]
    assert engines == {0, 2}
    assert adapters.choose("math", 3).engine == 1  # type: ignore[union-attr]
    adapters.update([_report(math=[4, 5]), _report(math=[4, 5])])
    assert adapters.choose("math", None).engine is None  # type: ignore[union-attr]


def test_why_an_adapter_has_nothing_to_serve() -> None:
    adapters = Adapters(["math"])
    adapters.update([{"math": {"versions": [], "refused": "adapter 'math': rank 16 exceeds",
                               "error": None}}])
    assert adapters.choose("math", None) is None
    assert "rank 16 exceeds" in adapters.why_none("math")
    adapters.update([{"math": {"versions": [], "refused": None, "error": None}}])
    assert "no version applied on this server yet" in adapters.why_none("math")
    adapters.update(["garbage", {"math": {"versions": [[1]]}}])  # malformed: nothing
    assert adapters.steps("math") == []


def test_marker_ids_are_ours_and_never_a_version() -> None:
    lo, hi = ADAPTER_IDS
    assert lo <= marker_id("math") < hi and marker_id("math") != marker_id("code")
    assert adapter_id("math", 3, "sha256:a") == adapter_id("math", 3, "sha256:a")
    assert adapter_id("math", 3, "sha256:a") != adapter_id("math", 3, "sha256:b")
    assert version_path("math", 3, "sha256:" + "ab" * 32) == MARKER + "math@3/" + "ab" * 8


class _Engine:
    """What admission needs of the engine (``versions.Engine``), engine-less."""

    def __init__(self, adapters: Adapters, later: list[dict[str, Any]] | None = None) -> None:
        self._adapters = adapters
        self._later = later
        self.wait_s = 0.3
        self.in_flight = "keep_kv"
        self.counted: list[str] = []

    @property
    def adapters(self) -> Adapters:
        return self._adapters

    async def refresh(self) -> None:
        if self._later is not None:
            self._adapters.update([self._later])

    async def current(self) -> str:
        return "0"

    def so_far(self, request_ids: Sequence[str]) -> list[str]:
        return []

    def count(self, reason: str) -> None:
        self.counted.append(reason)


def test_version_headers_apply_to_the_adapter() -> None:
    adapters = Adapters(["math"])
    adapters.update([_report(math=[4, 5])])
    engine = _Engine(adapters)

    def admit(step: int | None, demand: tuple[str, int] | None) -> Any:
        return asyncio.run(admit_adapter(engine, adapters, "math", step, demand))

    assert admit(None, ("exact", 4)).step == 4  # a kept step, exactly
    assert admit(None, ("min", 5)).step == 5
    code, body, headers = admit(None, ("exact", 3))
    assert code == 409 and body["error"]["reason"] == "exact_passed" and headers[
        "X-Weight-Version"] == "5"
    code, body, _ = admit(None, ("exact", 9))
    assert code == 409 and body["error"]["reason"] == "exact_behind"
    code, body, headers = admit(None, ("min", 6))  # waits min_version_wait_s, then 409
    assert code == 409 and body["error"]["reason"] == "min_timeout" and "Retry-After" in headers
    code, body, _ = admit(4, ("min", 5))  # math@4 never becomes 5: at once
    assert code == 409 and "math@4" in body["error"]["message"]
    assert admit(4, ("exact", 4)).step == 4
    code, body, _ = admit(3, None)
    assert code == 404 and "math@4, math@5" in body["error"]["message"]
    assert engine.counted == ["exact_passed", "exact_behind", "min_timeout", "min_timeout"]
    late = _Engine(adapters, _report(math=[5, 6]))  # a step applied since the last read
    assert asyncio.run(admit_adapter(late, adapters, "math", 6, None)).step == 6
    waiting = _Engine(Adapters(["math"]))
    waiting.adapters.update([{"math": {"versions": [], "refused": None, "error": None}}])
    code, body, _ = asyncio.run(admit_adapter(waiting, waiting.adapters, "math", None, None))
    assert code == 503


def _call(engine: _Engine, body: dict[str, Any],
          headers: dict[str, str] | None = None) -> tuple[int, Any, list[Any]]:
    """One POST /v1/completions through the middleware in front of an app standing for vLLM's
    (it reads the body, answers JSON); the status, the JSON answered, and what the app saw
    (its body and the chosen adapter version)."""
    seen: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        calls = CALLS.get()
        seen[:] = [json.loads(message["body"]), calls.adapter if calls is not None else None]
        answer = json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer, "more_body": False})

    middleware = VersionMiddleware(app, engine=lambda: engine)
    sent: list[dict[str, Any]] = []
    data = json.dumps(body).encode()
    chunks = [{"type": "http.request", "body": data[:7], "more_body": True},
              {"type": "http.request", "body": data[7:], "more_body": False}]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    asyncio.run(middleware(scope, receive, send))
    status = sent[0]["status"]
    answer = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    return status, answer, seen


@pytest.mark.parametrize(("model", "status", "step"), [
    ("math", 200, 5), ("math@4", 200, 4), ("math@3", 404, None), ("base", 200, None),
])
def test_the_middleware_answers_before_vllm(model: str, status: int, step: int | None) -> None:
    adapters = Adapters(["math"])
    adapters.update([_report(math=[4, 5])])
    got, answer, app_saw = _call(_Engine(adapters), {"model": model, "prompt": "hi"})
    assert got == status, answer
    if status == 404:
        assert not app_saw and "math@4, math@5" in answer["error"]["message"]
        return
    assert app_saw[0] == {"model": model, "prompt": "hi"}  # the body handed on unchanged
    chosen = app_saw[1]
    assert (chosen.step if chosen is not None else None) == step


def test_an_adapter_request_is_labelled_with_its_step() -> None:
    adapters = Adapters(["math"])
    adapters.update([_report(math=[5])])
    calls = Calls(adapters.choose("math", None))
    calls.start("r", 1)

    class Span:
        def __init__(self, version: str, start: int, end: int) -> None:
            self.version, self.start, self.end = version, start, end

    calls.record(0, 0, [Span("0", 0, 3), Span("1", 3, 8)])  # the base switched under it
    assert calls.by_choice() == {0: [{"version": "5", "start": 0, "end": 8}]}
    assert calls.fixed == "5"
