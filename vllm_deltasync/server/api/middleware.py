"""The API server's version middleware: admission for ``X-Min-/X-Exact-Weight-Version`` and the
version of every response (``server/api/versions.py`` holds the logic; vLLM's endpoint plugin,
``server/vllm/http.py``, adds this middleware to an API server naming the extension).

A JSON response is held until its body is complete, then gets ``weight_versions`` and the
``X-Weight-Version`` header; an event stream gets the header with its first chunk (the versions
of the tokens produced so far) and the spans in the chunk that finishes each choice. A
non-streamed ``X-Exact-Weight-Version`` request that a switch crossed is answered 409
(``exact_switched``): a 200 always means every token came from that step.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm_deltasync.server.api.adapters import Choice, parse_model
from vllm_deltasync.server.api.versions import (
    CALLS,
    EXACT_HEADER,
    HEADER,
    PATHS,
    BadDemand,
    Calls,
    Engine,
    admit,
    admit_adapter,
    conflict_body,
    header_value,
    inject,
    parse_demand,
)


class VersionMiddleware:
    """ASGI middleware on the API server: admission (``X-Min-/X-Exact-Weight-Version``) and the
    version of every response (module doc)."""

    def __init__(self, app: Any, engine: Callable[[], Engine | None]) -> None:
        self.app = app
        self.engine = engine
        """The engine once the API server has one (None before: requests pass unchanged)."""

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any],
                       send: Callable[..., Any]) -> None:
        state = self.engine()
        if (state is None or scope.get("type") != "http" or scope.get("method") != "POST"
                or scope.get("path") not in PATHS):
            await self.app(scope, receive, send)
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", ())]
        try:
            demand = parse_demand(headers)
        except BadDemand as exc:
            await _send_json(send, 400, {"error": {"message": str(exc), "type":
                                                   "BadRequestError", "code": 400,
                                                   "param": None}})
            return
        adapter: Choice | None = None
        adapters = state.adapters
        if adapters is not None:
            body, receive = await _read_body(receive)
            parsed = parse_model(_model_of(body), adapters.names)
            if parsed is not None:
                chosen = await admit_adapter(state, adapters, *parsed, demand)
                if not isinstance(chosen, Choice):
                    await _send_json(send, *chosen)
                    return
                adapter, demand = chosen, None  # the demand applied to the adapter
        if demand is not None:
            refused = await admit(state, *demand)
            if refused is not None:
                await _send_json(send, 409, refused[0], refused[1])
                return
        calls = Calls(adapter)
        token = CALLS.set(calls)
        try:
            await self.app(scope, receive, _Responder(send, state, calls, demand).send)
        finally:
            CALLS.reset(token)


async def _read_body(receive: Callable[..., Any]) -> tuple[bytes, Callable[..., Any]]:
    """The request's whole body, and a ``receive`` that hands it on unchanged."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            break  # a disconnect: the app sees it after the body
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(parts)
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return dict(await receive())

    return body, replay


def _model_of(body: bytes) -> Any:
    """The ``model`` of a JSON request body (None when it is not one)."""
    if b'"model"' not in body:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed.get("model") if isinstance(parsed, dict) else None


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

    def __init__(self, send: Callable[..., Any], state: Engine, calls: Calls,
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
            if inject(body, by_choice, in_flight=self._state.in_flight):
                data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        start = dict(self._start)
        start["headers"] = _with_header(start.get("headers", ()), header_value(versions),
                                        content_length=len(data))
        await self._send(start)
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def _stream(self, message: dict[str, Any]) -> None:
        if self._start is not None:
            versions = ([self._calls.fixed] if self._calls.fixed is not None else
                        self._state.so_far(self._calls.request_ids) or self._calls.versions())
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
        if isinstance(obj, dict) and inject(obj, self._calls.by_choice(), chunk=True,
                                            in_flight=self._state.in_flight):
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


__all__ = ["VersionMiddleware"]
