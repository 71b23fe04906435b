"""The API server's side of the vLLM boundary: vLLM's endpoint plugin and engine client.

:class:`DeltaSyncEndpoints` (vLLM's ``EndpointPlugin`` protocol) adds the version middleware
(``server/api/middleware.py``: ``X-Weight-Version``, ``weight_versions``, admission for
``X-Min-/X-Exact-Weight-Version``; the logic is ``server/api/versions.py``) to the API server of
an engine naming the extension, and gives it the engine through :class:`VersionState`: the
applied version (``get_weight_version``), the version record of a running request, and where
a 409 is counted (the engine core's ``deltasync_count_conflict``).

What vLLM's official points could not do, and what this module does instead (each listed in
:data:`.surface.SURFACE`):

- vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them (its security posture for
  new routes). The general plugin, which vLLM loads everywhere, wraps
  ``vllm.plugins.load_endpoint_plugins`` to hand this one to vLLM's loader, so
  ``--worker-extension-cls`` is the only switch; it adds no route and attaches nothing unless
  the server's arguments name the extension.
- The OpenAI responses drop ``CompletionOutput.weight_versions``. The plugin wraps the engine
  client's ``generate`` on its instance (the one the serving handlers call) to read the spans of
  each request's final output (:func:`tap_generate`).
- Followed LoRA adapters (``lora_urls``; ``server/api/adapters.py``): vLLM's serving layer
  resolves a request's ``model`` to a ``LoRARequest`` through ``OpenAIServingModels.
  lora_requests``, which is also what ``/v1/models`` lists. :class:`AdapterEntries` registers
  there ``<name>`` and each kept ``<name>@<step>`` (refreshed from every engine's
  ``deltasync_lora_versions``, one utility call per engine), with a marker ``lora_path`` no
  loader reads; the tapped ``generate`` replaces a marker by the exact version the middleware
  chose (``lora_name="<name>@<step>"``, its adapter id, its path), with the engine that keeps
  it (``data_parallel_rank``) when not every engine does. A version an engine retired since
  (it fails the request when it is added) is answered 404 naming the kept versions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from vllm_deltasync.server.api.adapters import (
    MARKER,
    Adapters,
    Choice,
    marker_id,
    marker_path,
    not_kept,
    parse_model,
    unavailable,
    version_name,
)
from vllm_deltasync.server.api.middleware import VersionMiddleware
from vllm_deltasync.server.api.versions import CALLS, Calls

logger = logging.getLogger(__name__)


class VersionState:
    """What the middleware needs from the engine (``server/api/versions.py`` ``Engine``): the
    applied version, the version record of a running request, and where to count a 409, read
    from vLLM's engine client. Built by :class:`DeltaSyncEndpoints` once the API server has
    one."""

    def __init__(self, engine_client: Any, wait_s: float, in_flight: str,
                 entries: AdapterEntries | None = None) -> None:
        self.client = engine_client
        self.wait_s = wait_s
        self.in_flight = in_flight
        self.entries = entries

    @property
    def adapters(self) -> Adapters | None:
        return None if self.entries is None else self.entries.adapters

    async def refresh(self) -> None:
        if self.entries is not None:
            await self.entries.refresh()

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
_BACKGROUND_REFRESH: set[asyncio.Task[None]] = set()


class AdapterEntries:
    """The followed adapters' entries in vLLM's ``OpenAIServingModels.lora_requests`` (module
    doc), refreshed from every engine every ``every_s`` seconds."""

    def __init__(self, engine_client: Any, models: Any, names: list[str], every_s: float) -> None:
        self.client = engine_client
        self.models = models
        self.adapters = Adapters(names)
        self.every_s = every_s
        self._lock = asyncio.Lock()
        self._registered: set[str] = set()
        for name in names:
            self._register(name, marker_id(name), marker_path(name))

    def _register(self, model: str, adapter: int, path: str) -> None:
        from vllm.lora.request import LoRARequest

        self.models.lora_requests[model] = LoRARequest(lora_name=model, lora_int_id=adapter,
                                                       lora_path=path)
        self._registered.add(model)

    async def refresh(self) -> None:
        """Read every engine's versions (``deltasync_lora_versions``) and register the kept
        ``<name>@<step>`` entries, removing the others."""
        async with self._lock:
            try:
                reports = await self.client.engine_core.call_utility_all_async(
                    "deltasync_lora_versions")
            except Exception as exc:  # noqa: BLE001 - the last view stays; retried
                logger.debug("deltasync: adapter versions not read: %s", exc)
                return
            self.adapters.update(list(reports))
            wanted: dict[str, Choice] = {}
            for name in self.adapters.names:
                for step in self.adapters.steps(name):
                    choice = self.adapters.choose(name, step)
                    if choice is not None:
                        wanted[choice.model] = choice
            for model in sorted(self._registered - set(wanted) - set(self.adapters.names)):
                self.models.lora_requests.pop(model, None)
                self._registered.discard(model)
            for model, choice in wanted.items():
                if model not in self.models.lora_requests:
                    self._register(model, choice.adapter, choice.path)

    async def run(self) -> None:
        """Refresh until the server stops."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.every_s)

    def resolve(self, lora: Any) -> Choice:
        """The version a marker ``LoRARequest`` stands for: the middleware's choice for this
        HTTP request, else chosen now; ``VLLMNotFoundError`` when none is kept."""
        from vllm.exceptions import VLLMNotFoundError

        parsed = parse_model(lora.lora_name, self.adapters.names)
        if parsed is None:
            raise VLLMNotFoundError(f"The model `{lora.lora_name}` does not exist.")
        name, step = parsed
        calls = CALLS.get()
        chosen = calls.adapter if calls is not None else None
        if chosen is not None and chosen.name == name and (step is None or step == chosen.step):
            return chosen
        found = self.adapters.choose(name, step)
        if found is None:
            body = (not_kept(self.adapters, name, step) if step is not None
                    else unavailable(self.adapters, name))
            raise VLLMNotFoundError(body["error"]["message"])
        return found


def tap_generate(engine_client: Any, entries: AdapterEntries | None = None) -> None:
    """Wrap ``generate`` on this engine client instance: within an HTTP request that the
    middleware watches, each engine request is recorded and its final spans kept; a followed
    adapter's marker ``LoRARequest`` is replaced by its exact version (``entries``)."""
    if getattr(engine_client, "_deltasync_tapped", False):
        return
    generate = engine_client.generate

    def tapped(*args: Any, **kwargs: Any) -> Any:
        calls = CALLS.get()
        lora = kwargs.get("lora_request")
        choice = None
        if entries is not None and lora is not None and str(lora.lora_path).startswith(MARKER):
            choice = entries.resolve(lora)
            kwargs["lora_request"] = _exact(choice)
            if choice.engine is not None and kwargs.get("data_parallel_rank") is None:
                kwargs["data_parallel_rank"] = choice.engine
        gen = generate(*args, **kwargs)
        if calls is None and choice is None:
            return gen
        if calls is None:
            calls = Calls(choice)
        elif choice is not None and calls.fixed is None:
            calls.adapter, calls.fixed = choice, str(choice.step)
        params = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else "")
        call = calls.start(str(request_id), getattr(params, "n", 1) or 1)
        return _record(gen, calls, call, entries if choice is not None else None)

    engine_client.generate = tapped
    engine_client._deltasync_tapped = True


def _exact(choice: Choice) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=choice.model, lora_int_id=choice.adapter, lora_path=choice.path)


async def _record(gen: Any, calls: Calls, call: int,
                  entries: AdapterEntries | None) -> AsyncIterator[Any]:
    try:
        async for out in gen:
            for o in getattr(out, "outputs", ()) or ():
                spans = getattr(o, "weight_versions", None)
                if spans:
                    calls.record(call, int(o.index), spans)
                if (entries is not None and calls.adapter is not None
                        and getattr(o, "finish_reason", None) == "error" and not o.token_ids):
                    await _retired(entries, calls.adapter)
            yield out
    finally:
        await gen.aclose()


async def _retired(entries: AdapterEntries, choice: Choice) -> None:
    """The engine failed an adapter request when it was added: its version was retired after
    the API read the versions (``server/engine/versions.py``). A 404 naming the kept ones."""
    from vllm.exceptions import VLLMNotFoundError

    await entries.refresh()
    body = not_kept(entries.adapters, choice.name, choice.step)
    raise VLLMNotFoundError(body["error"]["message"] + " (it was retired while the request "
                            f"was on its way to the engine: {version_name(choice.name, choice.step)})")


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
        from vllm_deltasync.server.vllm.guard import extension_named

        args = getattr(getattr(app, "state", None), "args", None)
        if not extension_named(getattr(args, "worker_extension_cls", "") or ""):
            return
        app.add_middleware(VersionMiddleware, engine=lambda: self.state)
        self.attached = True

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Keep the engine client (its ``generate`` tapped on the instance), the wait bound and
        the ``in_flight`` mode; with followed adapters, their entries in vLLM's model list
        (:class:`AdapterEntries`)."""
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
            config: SyncConfig | None = SyncConfig.from_sources(
                additional if isinstance(additional, Mapping) else None, os.environ)
        except DeltaSyncError:  # the engine core refuses and says why; admission still works
            config = None
        defaults = config if config is not None else SyncConfig
        wait_s, in_flight = defaults.min_version_wait_s, defaults.in_flight
        entries = None
        models = getattr(state, "openai_serving_models", None)
        if config is not None and config.lora_urls and models is not None:
            entries = AdapterEntries(engine_client, models, list(config.lora_urls),
                                     min(max(config.poll_interval_s, 0.1), 1.0))
            await entries.refresh()
            task = asyncio.get_running_loop().create_task(entries.run())
            _BACKGROUND_REFRESH.add(task)
        tap_generate(engine_client, entries)
        self.state = VersionState(engine_client, wait_s, in_flight, entries)


__all__ = ["AdapterEntries", "DeltaSyncEndpoints", "VersionState", "tap_generate"]
