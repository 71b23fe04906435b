"""The engine core's requests as vLLM's scheduler holds them: what ``server/engine/kv.py``
salts and preempts (its :class:`~vllm_deltasync.server.engine.kv.Requests`).

Every attribute here is a row of ``surface.py``. A request's salt is vLLM's own
``Request.cache_salt``; its block hashes are computed again by vLLM's own hasher
(``Request.update_block_hashes``, after clearing them), so the prefix cache keys them exactly
as vLLM keys a request that came with that salt. Preempting mirrors the loop of vLLM's
``Scheduler.reset_prefix_cache(reset_running_requests=True)`` (``_preempt_request`` with
``drop_stale_output``, the request ids of the last step forgotten), for the chosen requests
only and without dropping the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import monotonic
from typing import Any

from vllm_deltasync.server.engine.kv import IDLE, NEW, OTHER, RUNNING


class SchedulerRequests:
    """The requests of one engine core (``engine.scheduler``, read at each call)."""

    def __init__(self, engine: Any) -> None:
        from vllm.v1.request import RequestStatus

        self._engine = engine
        self._running = RequestStatus.RUNNING
        self._idle = RequestStatus.PREEMPTED
        self._new = frozenset({RequestStatus.WAITING,
                               RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR})

    def unfinished(self) -> list[Any]:
        return list(self._engine.scheduler.requests.values())

    def state(self, request: Any) -> str:
        status = request.status
        if status == self._running:
            return RUNNING
        if status == self._idle:
            return IDLE
        if status in self._new and request.num_computed_tokens == 0:
            return NEW
        return OTHER

    def salt(self, request: Any) -> str | None:
        salt = request.cache_salt
        return None if salt is None else str(salt)

    def resalt(self, request: Any, salt: str | None) -> None:
        request.cache_salt = salt
        request.block_hashes.clear()
        request.update_block_hashes()

    def preempt(self, requests: Sequence[Any]) -> int:
        scheduler = self._engine.scheduler
        chosen = {id(r) for r in requests}
        victims = [r for r in scheduler.running if id(r) in chosen]
        tokens = sum(int(r.num_computed_tokens) for r in victims)
        scheduler.running[:] = [r for r in scheduler.running if id(r) not in chosen]
        now = monotonic()
        for request in reversed(victims):  # prepended in turn: the waiting queue keeps FIFO
            scheduler._preempt_request(request, now, drop_stale_output=True)
        scheduler.prev_step_scheduled_req_ids.difference_update(r.request_id for r in victims)
        return tokens


__all__ = ["SchedulerRequests"]
