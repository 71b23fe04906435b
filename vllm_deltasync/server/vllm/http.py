"""Which weights served this request, over HTTP: vLLM's OpenAI endpoints and ``/inference/v1/generate``.

An endpoint plugin (vLLM's :class:`EndpointPlugin` protocol, ``vllm/plugins/endpoint_plugins``)
that vLLM attaches to the API server of an engine naming the extension. On
``POST /v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate``, streamed and
not, it adds:

- the response header ``X-Weight-Version``: the step that produced every token (``"7"``), or
  ``"first-last"`` when a switch happened while the request ran (``"7-8"``: the smallest and
  largest step among the request's spans). A streamed response sends its headers with its first
  chunk, before the last token exists: there the header covers the tokens produced when the
  first chunk left (exact for them, read from vLLM's own per-request version record), and the
  final chunk's ``weight_versions`` covers every token;
- the body field ``weight_versions`` at the top level of the response object (and of the chunk
  that finishes each choice): vLLM's own spans (``version``, ``start``, ``end`` over the
  choice's output tokens) with the choice's ``index``; each choice carries its own spans too.
  The official ``openai`` client keeps unknown top-level fields: ``response.weight_versions``
  or ``response.model_extra["weight_versions"]``.

A request can demand a version:

- ``X-Min-Weight-Version: N`` waits until the engine applied step N or newer, at most
  ``min_version_wait_s`` (default 5 s), else 409 with ``Retry-After`` and a JSON error naming
  the current and the required step;
- ``X-Exact-Weight-Version: N`` is served only if N is the applied step when it arrives (else
  409 at once). Switches are never held back for it (one client must not stall a fleet's
  policy): a non-streamed request that a switch crossed is answered 409 (``exact_switched``,
  its tokens dropped), so a 200 always means every token came from N; a streamed one cannot be
  taken back and carries the spans it really got;
- a value that is not a step (not an integer, negative, absurd) is answered 400 with one line.

409s are counted on the engine core's ``/metrics`` (``deltasync_version_conflicts_total``,
by reason); the steps-behind-at-admission histogram is kept by the engine core itself
(``deltasync_admission_steps_behind``, :mod:`.engine`).

What vLLM's official points could not do, and what this module does instead (each listed in
:data:`.surface.SURFACE`):

- vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them (its security posture for
  new routes). The general plugin, which vLLM loads everywhere, wraps
  ``vllm.plugins.load_endpoint_plugins`` to hand this one to vLLM's loader, so
  ``--worker-extension-cls`` is the only switch; it adds no route and attaches nothing unless
  the server's arguments name the extension.
- The OpenAI responses drop ``CompletionOutput.weight_versions``. The plugin wraps the engine
  client's ``generate`` on its instance (the one the serving handlers call) to read the spans of
  each request's final output, and adds them to the response in an ASGI middleware.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/inference/v1/generate"})
HEADER = "X-Weight-Version"
MIN_HEADER = "X-Min-Weight-Version"
EXACT_HEADER = "X-Exact-Weight-Version"
MAX_STEP = 10**12
"""Larger step numbers are refused as absurd (a trainer publishing one step per millisecond
would need 30 years to reach it)."""
POLL_S = 0.05
"""How often a request waiting for ``X-Min-Weight-Version`` asks the engine for its step."""

_CALLS: contextvars.ContextVar[Calls | None] = contextvars.ContextVar("deltasync_calls",
                                                                       default=None)


class BadDemand(ValueError):
    """A version header that is not a step."""


def parse_demand(headers: Mapping[str, str]) -> tuple[str, int] | None:
    """``("min", N)``, ``("exact", N)`` or None from the request headers (lower-case names);
    raises :class:`BadDemand` with one line naming the header and the fix."""
    found = [(kind, name, headers[name.lower()]) for kind, name in
             (("min", MIN_HEADER), ("exact", EXACT_HEADER)) if name.lower() in headers]
    if not found:
        return None
    if len(found) > 1:
        raise BadDemand(f"give one of {MIN_HEADER} and {EXACT_HEADER}, not both")
    kind, name, raw = found[0]
    text = raw.strip()
    if not re.fullmatch(r"[+-]?\d+", text):
        raise BadDemand(f"{name}: {raw[:40]!r} is not a step number; send a non-negative "
                        "integer, e.g. 12")
    value = int(text)
    if value < 0:
        raise BadDemand(f"{name}: {value} is negative; steps start at 0")
    if value > MAX_STEP:
        raise BadDemand(f"{name}: {text[:40]} is not a plausible step (> {MAX_STEP})")
    return kind, value


def step_of(label: str | None) -> int | None:
    """The step a vLLM weight-version label names (``"7"``), or None (``"default"`` before the
    first switch, ``"unknown"``, ``"inconsistent"``, a user's own label)."""
    if label is not None and re.fullmatch(r"\d+", label):
        return int(label)
    return None


def header_value(versions: Sequence[str]) -> str:
    """``X-Weight-Version`` for the versions a response's tokens came from: ``"7"``, ``"7-9"``
    (steps: the smallest and the largest), or the labels in order of first use, comma-separated,
    when one is not a step (``"default,0"``)."""
    distinct = list(dict.fromkeys(versions))
    if not distinct:
        return ""
    steps = [step_of(v) for v in distinct]
    if all(s is not None for s in steps):
        lo, hi = min(s for s in steps if s is not None), max(s for s in steps if s is not None)
        return str(lo) if lo == hi else f"{lo}-{hi}"
    return ",".join(distinct)


class Calls:
    """The engine requests one HTTP request made (one per prompt), and each choice's spans."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.fanout: list[int] = []
        self.spans: dict[tuple[int, int], list[dict[str, Any]]] = {}

    def start(self, request_id: str, n: int) -> int:
        self.request_ids.append(request_id)
        self.fanout.append(max(int(n), 1))
        return len(self.request_ids) - 1

    def record(self, call: int, index: int, spans: Sequence[Any]) -> None:
        self.spans[(call, index)] = [{"version": str(s.version), "start": int(s.start),
                                      "end": int(s.end)} for s in spans]

    def choice_index(self, call: int, index: int) -> int:
        """The response's choice index: vLLM numbers choices prompt by prompt, ``n`` each."""
        return sum(self.fanout[:call]) + index

    def by_choice(self) -> dict[int, list[dict[str, Any]]]:
        return {self.choice_index(c, i): spans for (c, i), spans in sorted(self.spans.items())}

    def versions(self) -> list[str]:
        return [s["version"] for _, spans in sorted(self.spans.items()) for s in spans]


def tagged(by_choice: Mapping[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The top-level ``weight_versions``: every choice's spans with its ``index``."""
    return [{"index": i, **s} for i, spans in sorted(by_choice.items()) for s in spans]


def inject(body: dict[str, Any], by_choice: Mapping[int, list[dict[str, Any]]], *,
           chunk: bool = False) -> bool:
    """Add the spans to a response object or a streamed ``chunk``: to each choice in
    ``by_choice`` (a chunk: only the choices it finishes) that lacks them, and at the top
    level. False when the object has no choice to annotate."""
    choices = body.get("choices")
    if not isinstance(choices, list):
        return False
    annotated: dict[int, list[dict[str, Any]]] = {}
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", 0)
        if chunk and choice.get("finish_reason") is None:
            continue  # a streamed chunk that does not finish this choice
        spans = by_choice.get(index)
        if spans is None:
            continue
        if not choice.get("weight_versions"):
            choice["weight_versions"] = spans
        annotated[index] = spans
    if not annotated:
        return False
    body["weight_versions"] = tagged(annotated)
    return True


def conflict_body(reason: str, message: str, current: str, required: int) -> dict[str, Any]:
    """The 409's JSON: OpenAI's error shape (the ``openai`` client raises ``ConflictError`` with
    it as ``.body``), plus the current and the required step."""
    return {"error": {"message": message, "type": "WeightVersionConflict", "code": 409,
                      "param": None, "reason": reason, "current_step": step_of(current),
                      "current_version": current, "required_step": required}}


class VersionState:
    """What the middleware needs from the engine: the applied version, the version record of a
    running request, and where to count a 409. Built by :class:`DeltaSyncEndpoints` once the
    API server has an engine client."""

    def __init__(self, engine_client: Any, wait_s: float) -> None:
        self.client = engine_client
        self.wait_s = wait_s

    async def current(self) -> str:
        """The weight version the engine reports now (``"mixed"`` while the engines of a data
        parallel server disagree)."""
        try:
            return str(await self.client.get_weight_version())
        except RuntimeError as exc:  # vLLM's consensus call: DP engines on different steps
            if "different" in str(exc):
                return "mixed"
            raise

    def so_far(self, request_ids: Sequence[str]) -> list[str]:
        """The versions of the tokens produced so far for these requests, from vLLM's own
        per-request record (``OutputProcessor``: the same record the final spans come from);
        empty when it cannot be read (then the caller asks the engine)."""
        try:
            processor = self.client.output_processor
            internal = processor.external_req_ids
            states = processor.request_states
            out: list[str] = []
            for rid in request_ids:
                for iid in internal.get(rid, ()):
                    state = states.get(iid)
                    if state is not None:
                        out += [str(v) for v, _ in state.weight_version_starts]
            return out
        except Exception:  # noqa: BLE001 - a private record: fall back to asking the engine
            return []

    def count(self, reason: str) -> None:
        """Count a 409 on the engine core's ``/metrics``, without delaying the answer."""
        async def send() -> None:
            try:
                await self.client.engine_core.call_utility_async(
                    "deltasync_count_conflict", reason)
            except Exception as exc:  # noqa: BLE001 - a metric, never the request's failure
                logger.debug("deltasync: could not count a 409 (%s): %s", reason, exc)

        task = asyncio.get_running_loop().create_task(send())
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)


_BACKGROUND: set[asyncio.Task[None]] = set()


def tap_generate(engine_client: Any) -> None:
    """Wrap ``generate`` on this engine client instance: within an HTTP request that the
    middleware watches, each engine request is recorded and its final spans kept."""
    if getattr(engine_client, "_deltasync_tapped", False):
        return
    generate = engine_client.generate

    def tapped(*args: Any, **kwargs: Any) -> Any:
        calls = _CALLS.get()
        gen = generate(*args, **kwargs)
        if calls is None:
            return gen
        params = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else "")
        call = calls.start(str(request_id), getattr(params, "n", 1) or 1)
        return _record(gen, calls, call)

    engine_client.generate = tapped
    engine_client._deltasync_tapped = True


async def _record(gen: Any, calls: Calls, call: int) -> AsyncIterator[Any]:
    try:
        async for out in gen:
            for o in getattr(out, "outputs", ()) or ():
                spans = getattr(o, "weight_versions", None)
                if spans:
                    calls.record(call, int(o.index), spans)
            yield out
    finally:
        await gen.aclose()


class VersionMiddleware:
    """ASGI middleware on the API server (added by :meth:`DeltaSyncEndpoints.attach_router`):
    admission (``X-Min-/X-Exact-Weight-Version``) and the version of every response."""

    def __init__(self, app: Any, plugin: DeltaSyncEndpoints) -> None:
        self.app = app
        self.plugin = plugin

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any],
                       send: Callable[..., Any]) -> None:
        state = self.plugin.state
        if (state is None or scope.get("type") != "http" or scope.get("method") != "POST"
                or scope.get("path") not in PATHS):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        try:
            demand = parse_demand(headers)
        except BadDemand as exc:
            await _send_json(send, 400, {"error": {"message": str(exc), "type":
                                                   "BadRequestError", "code": 400,
                                                   "param": None}})
            return
        if demand is not None:
            refused = await _admit(state, *demand)
            if refused is not None:
                await _send_json(send, 409, refused[0], refused[1])
                return
        calls = Calls()
        token = _CALLS.set(calls)
        try:
            await self.app(scope, receive, _Responder(send, state, calls, demand).send)
        finally:
            _CALLS.reset(token)


async def _admit(state: VersionState, kind: str,
                 step: int) -> tuple[dict[str, Any], dict[str, str]] | None:
    """None when the request may run now (after waiting for ``X-Min-Weight-Version``), else the
    409's body and headers."""
    current = await state.current()
    if kind == "exact":
        applied = step_of(current)
        if applied == step:
            return None
        reason = "exact_passed" if applied is not None and applied > step else "exact_behind"
        later = reason == "exact_behind"
        state.count(reason)
        message = (f"{EXACT_HEADER}: {step} is not the applied step ({current}); "
                   + ("retry once it is applied" if later else
                      "the server moved past it and never serves it again"))
        headers = {"Retry-After": "1"} if later else {}
        return conflict_body(reason, message, current, step), {**headers, HEADER: current}
    deadline = time.monotonic() + state.wait_s
    while True:
        applied = step_of(current)
        if applied is not None and applied >= step:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            break
        await asyncio.sleep(min(POLL_S, left))
        current = await state.current()
    state.count("min_timeout")
    message = (f"{MIN_HEADER}: step {step} is not applied after {state.wait_s:g} s (the "
               f"server serves {current}); retry later")
    retry = str(max(1, math.ceil(state.wait_s)))
    return (conflict_body("min_timeout", message, current, step),
            {"Retry-After": retry, HEADER: current})


async def _send_json(send: Callable[..., Any], status: int, body: dict[str, Any],
                     headers: Mapping[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class _Responder:
    """Rewrites one response on its way out: a JSON body gets the spans and the header (held
    until the body is complete); an event stream gets the header with its first chunk and the
    spans in the chunk that finishes each choice."""

    def __init__(self, send: Callable[..., Any], state: VersionState, calls: Calls,
                 demand: tuple[str, int] | None) -> None:
        self._send = send
        self._state = state
        self._calls = calls
        self._demand = demand
        self._start: dict[str, Any] | None = None
        self._mode = "pass"
        self._body: list[bytes] = []
        self._pending = b""

    async def send(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            content_type = b""
            for k, v in message.get("headers", ()):
                if k.lower() == b"content-type":
                    content_type = v.lower()
            if message.get("status") != 200:
                self._mode = "pass"
            elif content_type.startswith(b"text/event-stream"):
                self._mode = "stream"
            elif content_type.startswith(b"application/json"):
                self._mode = "json"
            if self._mode == "pass":
                await self._send(message)
            else:
                self._start = message
            return
        if kind != "http.response.body" or self._mode == "pass":
            await self._send(message)
            return
        if self._mode == "json":
            self._body.append(message.get("body", b""))
            if not message.get("more_body", False):
                await self._finish_json(b"".join(self._body))
            return
        await self._stream(message)

    async def _finish_json(self, data: bytes) -> None:
        assert self._start is not None
        by_choice = self._calls.by_choice()
        versions = self._calls.versions()
        try:
            body = json.loads(data)
        except ValueError:
            body = None
        if isinstance(body, dict):
            if (self._demand is not None and self._demand[0] == "exact"
                    and any(v != str(self._demand[1]) for v in versions)):
                self._state.count("exact_switched")
                message = (f"{EXACT_HEADER}: a switch to another step happened while the request "
                           f"ran (its tokens came from {header_value(versions)}); retry")
                current = await self._state.current()
                await _send_json(self._send, 409,
                                 conflict_body("exact_switched", message, current,
                                               self._demand[1]),
                                 {"Retry-After": "1", HEADER: current})
                return
            if inject(body, by_choice):
                data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        start = dict(self._start)
        start["headers"] = _with_header(start.get("headers", ()), header_value(versions),
                                        content_length=len(data))
        await self._send(start)
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def _stream(self, message: dict[str, Any]) -> None:
        if self._start is not None:
            versions = self._state.so_far(self._calls.request_ids) or self._calls.versions()
            value = header_value(versions) if versions else await self._state.current()
            start = dict(self._start)
            start["headers"] = _with_header(start.get("headers", ()), value)
            self._start = None
            await self._send(start)
        more = bool(message.get("more_body", False))
        *events, tail = (self._pending + message.get("body", b"")).split(b"\n\n")
        self._pending, tail = (tail, b"") if more else (b"", tail)
        body = b"".join(self._event(e) + b"\n\n" for e in events) + tail
        if body or not more:
            await self._send({"type": "http.response.body", "body": body, "more_body": more})

    def _event(self, event: bytes) -> bytes:
        if (not event.startswith(b"data:") or b'"finish_reason"' not in event
                or event.count(b'"finish_reason":null') == event.count(b'"finish_reason"')):
            return event  # no choice finishes here: passed on unparsed
        payload = event[len(b"data:"):].strip()
        try:
            obj = json.loads(payload)
        except ValueError:
            return event
        if isinstance(obj, dict) and inject(obj, self._calls.by_choice(), chunk=True):
            return b"data: " + json.dumps(obj, ensure_ascii=False,
                                          separators=(",", ":")).encode()
        return event


def _with_header(headers: Sequence[tuple[bytes, bytes]], value: str, *,
                 content_length: int | None = None) -> list[tuple[bytes, bytes]]:
    skip = {HEADER.lower().encode()} | ({b"content-length"} if content_length is not None
                                        else set())
    out = [(k, v) for k, v in headers if k.lower() not in skip]
    if content_length is not None:
        out.append((b"content-length", str(content_length).encode()))
    if value:
        out.append((HEADER.lower().encode(), value.encode("latin-1", "replace")))
    return out


class DeltaSyncEndpoints:
    """vLLM's ``EndpointPlugin`` protocol: ``name``, ``required_tasks``, ``attach_router``,
    ``init_state``. Handed to vLLM's endpoint-plugin loader by the general plugin
    (:func:`.plugin.register_plugin`)."""

    name = "deltasync"
    required_tasks: tuple[str, ...] | None = ("generate",)

    def __init__(self) -> None:
        self.state: VersionState | None = None
        self.attached = False

    def attach_router(self, app: Any) -> None:
        """Add the middleware when the server's arguments name the extension; else nothing."""
        from vllm_deltasync.server.vllm.plugin import extension_named

        args = getattr(getattr(app, "state", None), "args", None)
        if not extension_named(getattr(args, "worker_extension_cls", "") or ""):
            return
        app.add_middleware(VersionMiddleware, plugin=self)
        self.attached = True

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Keep the engine client (its ``generate`` tapped on the instance) and the wait bound."""
        del state
        if not self.attached or engine_client is None:
            return
        from vllm_deltasync.config import SyncConfig
        from vllm_deltasync.errors import DeltaSyncError

        additional = getattr(args, "additional_config", None)
        if isinstance(additional, str):
            try:
                additional = json.loads(additional)
            except ValueError:
                additional = None
        try:
            wait_s = SyncConfig.from_sources(
                additional if isinstance(additional, Mapping) else None,
                os.environ).min_version_wait_s
        except DeltaSyncError:  # the engine core refuses and says why; admission still works
            wait_s = SyncConfig.min_version_wait_s
        tap_generate(engine_client)
        self.state = VersionState(engine_client, wait_s)


__all__ = ["EXACT_HEADER", "HEADER", "MIN_HEADER", "BadDemand", "Calls", "DeltaSyncEndpoints",
           "VersionMiddleware", "header_value", "inject", "parse_demand", "step_of",
           "tap_generate"]
