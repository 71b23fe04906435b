"""Which weights a request's KV cache comes from: the prefix-cache salt, and what running
requests do at a switch (``in_flight``).

vLLM keys its prefix cache on each request's block hashes, chained from the first block, whose
hash covers the request's ``cache_salt`` (and its LoRA adapter's name). Here every request
carries a salt derived from the identities of the weights it runs on (:func:`cache_salt`),
combined with the user's own ``cache_salt``, never replacing it: a request can hit only blocks
computed by the same weights (and, with a salt of its own, for the same user). Blocks of other
versions are not dropped: no new request can reach them, and they age out under vLLM's LRU
(or serve again when a switch is taken back). Before the first switch (the loaded checkpoint)
a request keeps exactly the salt it came with.

The identities that determine a request's weights: the applied manifest identity of every
target whose ``SwitchPolicy.kv_scope`` is ``"every"`` (the policy). Never the drafter's
(``kv_scope="none"``): the target model's KV depends only on the target's weights, and
speculative decoding's output is the target model's whatever the draft; a draft layer's KV
computed by an older draft only lowers acceptance. Nor a followed LoRA adapter's
(``kv_scope="none"``): each of its steps is a vLLM adapter of its own name
(``server/engine/versions.py``), and vLLM's block hashes already cover that name.

At a switch (:meth:`KvVersions.switched`), for the requests the switched weights determine:

* not started (waiting, nothing computed): re-salted to the new identities;
* running, by ``in_flight``:
  ``keep_kv``: they continue on the new weights from the KV computed so far (no recompute);
  they keep the salt they were admitted with, so the blocks they fill later, which attended to
  KV of the old weights, are never reused by a request of the new version;
  ``continue``, and what a ``drain`` left running after ``max_drain_wait_s``: preempted (as
  vLLM's ``reset_prefix_cache(reset_running_requests=True)`` preempts, but only these) and
  re-salted: their whole KV is computed again on the new weights, reusing blocks of the new
  version only; a started request waiting after a preemption is re-salted too;
* anything else (a streaming-input session between its inputs, a request waiting for KV from
  another engine) keeps its salt and its KV.

Everything here runs on the engine core's busy-loop thread (in-process: the caller's), where
switches happen, so admission (:meth:`KvVersions.admit`, each request as the engine core adds
it) and switches are ordered: a request added before a switch is in the scheduler when the
switch re-salts, one added after it gets the new salt. The requests themselves (vLLM's
``Request`` objects, the scheduler's queues) are reached only through :class:`Requests`,
implemented in ``server/vllm/scheduler.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

SALT_PREFIX = "deltasync-kv:"
"""How a salt of ours starts (the digest of the identities follows, then the user's salt)."""

NEW, RUNNING, IDLE, OTHER = "new", "running", "idle", "other"
"""A request's state as :meth:`Requests.state` reports it: not started; running (holds KV);
started but holding no KV (preempted); anything else (left as it is)."""

RECOMPUTES = frozenset({"continue", "drain"})
"""``in_flight`` modes whose running requests compute their KV again at a switch."""


def cache_salt(user: str | None, identities: Iterable[tuple[str, str]]) -> str | None:
    """The salt of a request whose own salt is ``user`` and whose weights are ``identities``
    (key, applied identity). ``user`` when there are none (vLLM's own keying); else
    ``deltasync-kv:<digest>`` followed by ``:<user>`` when the user gave one: different users
    or different weights never share a salt, the same user on the same weights always does."""
    pairs = sorted(set(identities))
    if not pairs:
        return user
    digest = hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:32]
    return SALT_PREFIX + digest if user is None else f"{SALT_PREFIX}{digest}:{user}"


def unknown_identity(key: str) -> str:
    """An identity no other weights share: weights written behind our back, or a switch whose
    manifest identity is unknown (format 1)."""
    return f"unknown:{key}:{secrets.token_hex(8)}"


class Requests(Protocol):
    """The engine core's unfinished requests, as vLLM's scheduler holds them."""

    def unfinished(self) -> list[Any]:
        """Every unfinished request (running, waiting, preempted)."""

    def state(self, request: Any) -> str:
        """:data:`NEW`, :data:`RUNNING`, :data:`IDLE` or :data:`OTHER`."""

    def salt(self, request: Any) -> str | None:
        """The request's ``cache_salt`` now."""

    def resalt(self, request: Any, salt: str | None) -> None:
        """Give the request ``salt`` and compute its block hashes again from it."""

    def preempt(self, requests: Sequence[Any]) -> int:
        """Preempt these running requests (their KV is computed again when they are scheduled
        next); the KV tokens they drop."""


@dataclass(frozen=True)
class KvSwitch:
    """What one switch did to the requests it concerned."""

    in_flight: str
    resalted: int = 0
    """Requests re-salted to the new identities (not started, or preempted and recomputed)."""
    kept: int = 0
    """Running requests that continue on the new weights from their KV (``keep_kv``), and
    requests left as they were (a session between its inputs)."""
    recomputed: int = 0
    """Running requests preempted to compute their KV again on the new weights."""
    recompute_tokens: int = 0
    """The KV tokens those had computed (computed again)."""


class KvVersions:
    """The identities the engine's requests are salted with, owned by the coordinator on the
    busy-loop thread (module doc). ``requests``: None where vLLM's requests cannot be reached
    (the engine-less unit tests): identities are kept, nothing is salted. ``every``: the keys
    of the targets whose weights determine every request's KV (``kv_scope="every"``)."""

    def __init__(self, requests: Requests | None, every: Sequence[str]) -> None:
        self._requests = requests
        self._every = frozenset(every)
        self.identities: dict[str, str] = {}
        """Key -> applied identity (only keys that switched at least once)."""
        self._users: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()
        """Each request seen -> the salt it came with (the user's own, or None)."""
        self.admitted = 0
        """Requests admitted with a salt of ours."""

    def keys_of(self, request: Any) -> list[str]:
        """The keys whose identities determine ``request``'s weights (followed ones only)."""
        return [k for k in self._every if k in self.identities]

    def salt_for(self, request: Any) -> str | None:
        """The salt ``request`` runs with on the weights applied now."""
        return cache_salt(self._user(request),
                          ((k, self.identities[k]) for k in self.keys_of(request)))

    def _user(self, request: Any) -> str | None:
        if request not in self._users:
            assert self._requests is not None
            self._users[request] = self._requests.salt(request)
        return self._users[request]

    def admit(self, request: Any) -> None:
        """A request the engine core is adding: salted by the weights applied now."""
        if self._requests is None or not self.identities:
            return
        want = self.salt_for(request)
        if want != self._requests.salt(request):
            self._requests.resalt(request, want)
            self.admitted += 1

    def _concerned(self, key: str) -> list[Any]:
        """The requests the weights of ``key`` determine: every unfinished one for a key with
        ``kv_scope="every"``, none for any other (module doc)."""
        return self._unfinished() if key in self._every else []

    def switched(self, key: str, identity: str, in_flight: str) -> KvSwitch:
        """The weights of ``key`` are now ``identity``: re-salt and preempt as ``in_flight``
        says (module doc)."""
        for request in self._unfinished():
            self._user(request)  # the salt it came with, before it is changed
        self.identities[key] = identity
        if self._requests is None:
            return KvSwitch(in_flight)
        mine = self._concerned(key)
        states = {id(r): self._requests.state(r) for r in mine}
        running = [r for r in mine if states[id(r)] == RUNNING]
        recompute = in_flight in RECOMPUTES
        tokens = self._requests.preempt(running) if recompute and running else 0
        resalt = [r for r in mine if states[id(r)] == NEW
                  or (recompute and states[id(r)] in (RUNNING, IDLE))]
        for request in resalt:
            self._requests.resalt(request, self.salt_for(request))
        recomputed = len(running) if recompute else 0
        return KvSwitch(in_flight, resalted=len(resalt), kept=len(mine) - len(resalt),
                        recomputed=recomputed, recompute_tokens=tokens)

    def restore(self, key: str, identity: str | None) -> None:
        """A switch of ``key`` taken back before any batch ran on it: its identity is
        ``identity`` again (None: it never had one), and every request of it that holds no KV
        is salted by it again (running requests computed all their KV on these weights)."""
        if identity is None:
            self.identities.pop(key, None)
        else:
            self.identities[key] = identity
        if self._requests is None:
            return
        for request in self._concerned(key):
            if self._requests.state(request) in (NEW, IDLE):
                want = self.salt_for(request)
                if want != self._requests.salt(request):
                    self._requests.resalt(request, want)

    def _unfinished(self) -> list[Any]:
        return [] if self._requests is None else self._requests.unfinished()


__all__ = ["IDLE", "NEW", "OTHER", "RECOMPUTES", "RUNNING", "SALT_PREFIX", "KvSwitch",
           "KvVersions", "Requests", "cache_salt", "unknown_identity"]
