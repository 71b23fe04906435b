"""Which version of a followed LoRA adapter serves a request: the API server's resolution.

A request names a followed adapter (``lora_urls``) as ``model="<name>"`` (the newest step
applied) or ``model="<name>@<step>"`` (exactly that step, while it is kept). Every engine
reports the versions requests may use on it (``deltasync_lora_versions``: step, vLLM adapter
id, manifest identity; ``server/engine/versions.py``); :class:`Adapters` holds the last report
of each engine (a data-parallel server's engines each follow by themselves) and
:meth:`Adapters.choose` picks the version and, when not every engine keeps it, the engine
(``data_parallel_rank``) that does. ``server/vllm/http.py`` turns the choice into vLLM's
``LoRARequest`` (:func:`version_name`, :func:`version_path`); ``middleware.py`` answers what
cannot be served before vLLM sees the request (:func:`not_kept`, :func:`unavailable`) and
applies ``X-Min-/X-Exact-Weight-Version`` to the adapter the request names.

The race left: an engine may retire a version between the last report and the request's
arrival there. The engine core then fails the request when it is added (it never reaches a
worker), and the API answers 404 naming the kept versions (``server/vllm/http.py``).

Pure logic: no vLLM, no I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_deltasync.server.targets import ADAPTER_IDS

MARKER = "deltasync://"
"""How the ``lora_path`` of a followed adapter's ``LoRARequest`` starts: no loader can read it
(a version is loaded from memory on every rank, never from a path)."""
_VERSION = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,63})@(?P<step>[0-9]{1,13})")


def version_name(name: str, step: int) -> str:
    """``<name>@<step>``: a version's model name (and vLLM ``lora_name``, which vLLM puts in
    every prefix-cache block hash: versions never share blocks)."""
    return f"{name}@{step}"


def version_path(name: str, step: int, identity: str | None) -> str:
    """A version's marker ``lora_path`` (also in vLLM's block hashes): a step number a
    restarted trainer publishes again gets another path."""
    short = (identity or "").removeprefix("sha256:")[:16] or "unknown"
    return f"{MARKER}{version_name(name, step)}/{short}"


def marker_path(name: str) -> str:
    """The ``lora_path`` of the entry ``<name>`` registered for vLLM's model check."""
    return MARKER + name


def marker_id(name: str) -> int:
    """The adapter id of the ``<name>`` entry: in our id range (an engine core refuses it if
    it ever arrives unresolved), never a version's."""
    digest = hashlib.sha256(f"marker\0{name}".encode()).digest()
    lo, hi = ADAPTER_IDS
    return lo + int.from_bytes(digest[:8], "big") % (hi - lo)


def parse_model(model: Any, names: Collection[str]) -> tuple[str, int | None] | None:
    """``(name, None)`` for ``<name>``, ``(name, step)`` for ``<name>@<step>`` of a followed
    adapter; None for anything else (the base model, another adapter: vLLM's)."""
    if not isinstance(model, str):
        return None
    if model in names:
        return model, None
    found = _VERSION.fullmatch(model)
    if found is None or found["name"] not in names:
        return None
    return found["name"], int(found["step"])


@dataclass(frozen=True)
class Version:
    step: int
    adapter: int
    """vLLM's adapter id (``lora_int_id``)."""
    identity: str | None


@dataclass(frozen=True)
class EngineReport:
    """One engine's report of one adapter."""

    versions: tuple[Version, ...] = ()
    refused: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Choice:
    """The version that serves a request, and the engine that must serve it (None: any)."""

    name: str
    step: int
    adapter: int
    identity: str | None
    engine: int | None

    @property
    def model(self) -> str:
        return version_name(self.name, self.step)

    @property
    def path(self) -> str:
        return version_path(self.name, self.step, self.identity)


class Adapters:
    """The followed adapters' versions as each engine last reported them (module doc)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.engines: list[dict[str, EngineReport]] = []
        """Per engine (data-parallel rank order): adapter name -> its report."""
        self._next = 0

    def update(self, reports: Sequence[Any]) -> None:
        """Each engine's ``deltasync_lora_versions`` answer (malformed entries: nothing)."""
        self.engines = [_parse(r, self.names) for r in reports]

    def steps(self, name: str) -> list[int]:
        """The steps of ``name`` some engine keeps, ascending."""
        return sorted({v.step for e in self.engines for v in e.get(name, EngineReport()).versions})

    def newest(self, name: str) -> int | None:
        steps = self.steps(name)
        return steps[-1] if steps else None

    def choose(self, name: str, step: int | None) -> Choice | None:
        """The version of ``name`` at ``step`` (None: the newest any engine applied), and the
        engine to serve it when not every engine keeps it (the next of those that do, in
        turn); None when no engine keeps it."""
        want = self.newest(name) if step is None else step
        if want is None:
            return None
        holders = [(i, v) for i, e in enumerate(self.engines)
                   for v in e.get(name, EngineReport()).versions if v.step == want]
        if not holders:
            return None
        engine: int | None = None
        if len({i for i, _ in holders}) < len(self.engines):
            self._next += 1
            engine = holders[self._next % len(holders)][0]
        i, version = holders[0] if engine is None else next(h for h in holders if h[0] == engine)
        return Choice(name, want, version.adapter, version.identity, engine)

    def why_none(self, name: str) -> str:
        """Why ``name`` has no version to serve (refused, failing, or nothing applied yet)."""
        reports = [e[name] for e in self.engines if name in e]
        refused = next((r.refused for r in reports if r.refused), None)
        if refused:
            return refused
        error = next((r.error for r in reports if r.error), None)
        return (f"adapter {name!r} has no version applied on this server yet"
                + (f" (last error: {error})" if error else ""))


def _parse(report: Any, names: Collection[str]) -> dict[str, EngineReport]:
    out: dict[str, EngineReport] = {}
    if not isinstance(report, Mapping):
        return out
    for name, entry in report.items():
        if name not in names or not isinstance(entry, Mapping):
            continue
        versions = tuple(Version(int(v[0]), int(v[1]), v[2] if isinstance(v[2], str) else None)
                         for v in entry.get("versions") or ()
                         if isinstance(v, (list, tuple)) and len(v) == 3)
        out[name] = EngineReport(versions, _text(entry.get("refused")), _text(entry.get("error")))
    return out


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def error_body(status: int, kind: str, message: str, **extra: Any) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "code": status, "param": "model",
                      **extra}}


def not_kept(adapters: Adapters, name: str, step: int) -> dict[str, Any]:
    """The 404 of ``<name>@<step>`` when that step is not kept: the kept ones named."""
    kept = adapters.steps(name)
    listed = ", ".join(version_name(name, s) for s in kept) or "none yet"
    return error_body(404, "NotFoundError",
                      f"The model `{version_name(name, step)}` is not kept on this server "
                      f"(kept versions of {name!r}: {listed}); use `{name}` for the newest",
                      kept_steps=kept)


def unavailable(adapters: Adapters, name: str) -> dict[str, Any]:
    """The 503 of ``<name>`` when no version of it is servable."""
    return error_body(503, "ServiceUnavailableError", adapters.why_none(name))


__all__ = ["MARKER", "Adapters", "Choice", "EngineReport", "Version", "error_body",
           "marker_id", "marker_path", "not_kept", "parse_model", "unavailable",
           "version_name", "version_path"]
