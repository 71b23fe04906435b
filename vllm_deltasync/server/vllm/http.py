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
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from vllm_deltasync.server.api.middleware import VersionMiddleware
from vllm_deltasync.server.api.versions import CALLS, Calls

logger = logging.getLogger(__name__)


class VersionState:
    """What the middleware needs from the engine (``server/api/versions.py`` ``Engine``): the
    applied version, the version record of a running request, and where to count a 409, read
    from vLLM's engine client. Built by :class:`DeltaSyncEndpoints` once the API server has
    one."""

    def __init__(self, engine_client: Any, wait_s: float, in_flight: str) -> None:
        self.client = engine_client
        self.wait_s = wait_s
        self.in_flight = in_flight

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
        calls = CALLS.get()
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
        the ``in_flight`` mode."""
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
            config = SyncConfig.from_sources(
                additional if isinstance(additional, Mapping) else None, os.environ)
            wait_s, in_flight = config.min_version_wait_s, config.in_flight
        except DeltaSyncError:  # the engine core refuses and says why; admission still works
            wait_s, in_flight = SyncConfig.min_version_wait_s, SyncConfig.in_flight
        tap_generate(engine_client)
        self.state = VersionState(engine_client, wait_s, in_flight)


__all__ = ["DeltaSyncEndpoints", "VersionState", "tap_generate"]
