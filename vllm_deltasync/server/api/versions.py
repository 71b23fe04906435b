"""Which weights served a request, and which a request demands: the HTTP version logic.

Pure logic of the API server's version feature (``server/api/middleware.py`` applies it to
responses, ``server/vllm/http.py`` hands it vLLM's engine client). For
``POST /v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate``:

- the header ``X-Weight-Version`` (:func:`header_value`): the step that produced every token
  (``"7"``), or ``"first-last"`` when a switch happened while the request ran;
- the body field ``weight_versions`` (:func:`inject`): vLLM's own spans (``version``,
  ``start``, ``end``) with the choice's ``index``, at the top level and in each choice;
- admission (:func:`parse_demand`, :func:`admit`): ``X-Min-Weight-Version: N`` waits until step
  N or newer is applied (at most ``min_version_wait_s``, else 409 with ``Retry-After``);
  ``X-Exact-Weight-Version: N`` is served only while N is the applied step (else 409). A value
  that is not a step, an over-long value, a header given twice, or both headers: 400 with one
  line naming the header.

For a request naming a followed LoRA adapter (``model="<name>"`` or ``"<name>@<step>"``,
``adapters.py``) the version is the adapter's step: :func:`admit_adapter` chooses the version
that serves it and applies the headers to that adapter (``X-Min-Weight-Version: N``: the
newest step of the adapter, once it is N or newer; ``X-Exact-Weight-Version: N``: step N while
it is kept), and the spans and the header carry the adapter's step (:attr:`Calls.fixed`: a
request never changes version).
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from vllm_deltasync.server.api.adapters import Adapters, Choice, not_kept, unavailable

PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/inference/v1/generate"})
HEADER = "X-Weight-Version"
MIN_HEADER = "X-Min-Weight-Version"
EXACT_HEADER = "X-Exact-Weight-Version"
MAX_STEP = 10**12
"""Larger step numbers are refused as absurd (a trainer publishing one step per millisecond
would need 30 years to reach it)."""
POLL_S = 0.05
"""How often a request waiting for ``X-Min-Weight-Version`` asks the engine for its step."""



MAX_DIGITS = 20
"""A header value longer than this is refused before any number is made of it (Python's
``int()`` of more than 4,300 digits raises)."""

class BadDemand(ValueError):
    """A version header that is not a step."""


def parse_demand(headers: Sequence[tuple[str, str]]) -> tuple[str, int] | None:
    """``("min", N)``, ``("exact", N)`` or None from the request's headers (name, value pairs,
    names in any case); raises :class:`BadDemand` with one line naming the header and the fix
    (red team S10, S11: an over-long value and a header given twice are refused too)."""
    found = [(kind, name, value) for kind, name in (("min", MIN_HEADER), ("exact", EXACT_HEADER))
             for key, value in headers if key.lower() == name.lower()]
    if not found:
        return None
    names = [name for _, name, _ in found]
    for name in (MIN_HEADER, EXACT_HEADER):
        if names.count(name) > 1:
            raise BadDemand(f"{name} is given {names.count(name)} times; send it once")
    if len(found) > 1:
        raise BadDemand(f"give one of {MIN_HEADER} and {EXACT_HEADER}, not both")
    kind, name, raw = found[0]
    text = raw.strip()
    if len(text) > MAX_DIGITS:
        raise BadDemand(f"{name}: a value of {len(text)} characters is not a step number; send "
                        f"a non-negative integer of at most {MAX_DIGITS} digits, e.g. 12")
    if not re.fullmatch(r"[+-]?[0-9]+", text):
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

    def __init__(self, adapter: Choice | None = None) -> None:
        self.request_ids: list[str] = []
        self.fanout: list[int] = []
        self.spans: dict[tuple[int, int], list[dict[str, Any]]] = {}
        self.adapter = adapter
        """The adapter version the middleware chose for this request (``admit_adapter``)."""
        self.fixed: str | None = None if adapter is None else str(adapter.step)
        """The one version of every token (an adapter request's step), else None."""
        self.retired: str | None = None
        """Why an engine refused the request's adapter version when it was added."""

    def start(self, request_id: str, n: int) -> int:
        self.request_ids.append(request_id)
        self.fanout.append(max(int(n), 1))
        return len(self.request_ids) - 1

    def record(self, call: int, index: int, spans: Sequence[Any]) -> None:
        rows = [{"version": str(s.version), "start": int(s.start), "end": int(s.end)}
                for s in spans]
        if self.fixed is not None and rows:  # an adapter version: one span of its step
            rows = [{"version": self.fixed, "start": rows[0]["start"], "end": rows[-1]["end"]}]
        self.spans[(call, index)] = rows

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
           chunk: bool = False, in_flight: str | None = None) -> bool:
    """Add the spans to a response object or a streamed ``chunk``: to each choice in
    ``by_choice`` (a chunk: only the choices it finishes) that lacks them, and at the top
    level. A choice whose tokens came from more than one version also says what its running
    sequence did at the switch (``in_flight``: ``keep_kv``, ``continue``, ``drain``: the
    server's mode, docs/extension.md "Switch semantics"). False when the object has no choice
    to annotate."""
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
        if in_flight and len({str(s.get("version")) for s in spans}) > 1:
            choice["in_flight"] = in_flight
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


class Engine(Protocol):
    """What admission and the responses need from the serving engine (``server/vllm/http.py``
    builds it from vLLM's engine client)."""

    wait_s: float
    """``min_version_wait_s``."""

    in_flight: str
    """The server's ``in_flight`` mode, stated in each choice a switch crossed."""

    async def current(self) -> str:
        """The weight version the engine reports now."""

    def so_far(self, request_ids: Sequence[str]) -> list[str]:
        """The versions of the tokens produced so far for these requests (empty: unknown)."""

    def count(self, reason: str) -> None:
        """Count a 409 on the engine core's ``/metrics``."""

    @property
    def adapters(self) -> Adapters | None:
        """The followed LoRA adapters' versions (None: the server follows none)."""

    async def refresh(self) -> None:
        """Read the engines' adapter versions now."""


CALLS: contextvars.ContextVar[Calls | None] = contextvars.ContextVar("deltasync_calls",
                                                                     default=None)
"""The engine requests of the HTTP request being served (set by the middleware, filled by the
engine client's tapped ``generate``)."""


async def admit(state: Engine, kind: str,
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


async def admit_adapter(state: Engine, adapters: Adapters, name: str, step: int | None,
                        demand: tuple[str, int] | None
                        ) -> Choice | tuple[int, dict[str, Any], dict[str, str]]:
    """The version of adapter ``name`` that serves a request for ``<name>`` (``step`` None)
    or ``<name>@<step>``, with the request's ``demand`` applied to the adapter (module doc);
    else the status, body and headers to answer (404 for a step not kept, 503 when nothing is
    servable, 409 for a demand it cannot meet)."""
    if demand is not None:
        out = await _adapter_demand(state, adapters, name, step, demand)
        if not isinstance(out, int):
            return out
        step = out
    choice = adapters.choose(name, step)
    if choice is None and step is not None:
        await state.refresh()  # a step applied since the last read
        choice = adapters.choose(name, step)
    if choice is not None:
        return choice
    if step is not None and adapters.newest(name) is not None:
        return 404, not_kept(adapters, name, step), {}
    return 503, unavailable(adapters, name), {"Retry-After": "1"}


async def _adapter_demand(state: Engine, adapters: Adapters, name: str, step: int | None,
                          demand: tuple[str, int]
                          ) -> int | tuple[int, dict[str, Any], dict[str, str]]:
    """The step to serve under ``demand``, or the 409 (``admit`` for an adapter)."""
    kind, want = demand
    if kind == "exact":
        if (step is None or step == want) and want in adapters.steps(name):
            return want
        newest = adapters.newest(name)
        reason = "exact_passed" if newest is not None and newest > want else "exact_behind"
        if step is not None and step != want:
            reason = "exact_passed" if step < want else "exact_behind"
        message = (f"{EXACT_HEADER}: step {want} of adapter {name!r} is not "
                   + (f"the requested {name}@{step}" if step is not None else "kept")
                   + f" (kept: {adapters.steps(name)})")
        return _adapter_conflict(state, adapters, name, reason, message, want)
    deadline = time.monotonic() + (0.0 if step is not None else state.wait_s)
    while True:
        have = step if step is not None else adapters.newest(name)
        if have is not None and have >= want:
            return have
        left = deadline - time.monotonic()
        if left <= 0:
            break
        await asyncio.sleep(min(POLL_S, left))
        await state.refresh()
    message = (f"{MIN_HEADER}: step {want} of adapter {name!r} is not applied"
               + (f" (the request names {name}@{step})" if step is not None else
                  f" after {state.wait_s:g} s (newest: {adapters.newest(name)}); retry later"))
    return _adapter_conflict(state, adapters, name, "min_timeout", message, want)


def _adapter_conflict(state: Engine, adapters: Adapters, name: str, reason: str, message: str,
                      want: int) -> tuple[int, dict[str, Any], dict[str, str]]:
    state.count(reason)
    current = str(adapters.newest(name)) if adapters.newest(name) is not None else "none"
    headers = {HEADER: current}
    if reason in ("exact_behind", "min_timeout"):
        headers["Retry-After"] = "1"
    return 409, conflict_body(reason, message, current, want), headers


__all__ = ["CALLS", "EXACT_HEADER", "HEADER", "MAX_DIGITS", "MIN_HEADER", "PATHS", "BadDemand",
           "Calls", "Engine", "admit", "admit_adapter", "conflict_body", "header_value", "inject",
           "parse_demand", "step_of", "tagged"]
