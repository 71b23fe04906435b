"""The versions of a target whose steps are kept side by side (a LoRA adapter): which ones
requests may use, and when an older one is removed.

Every rank registers a new version at each switch (``server/worker/adapters.py``) and reports
the versions it holds (``TargetStatus.versions``: step, vLLM adapter id, manifest identity).
On the engine core, one :class:`KeptVersions` per such target (``SwitchPolicy.versions_kept``)
decides, from the ranks' statuses and the requests the scheduler holds:

- **servable**: the versions every rank holds, not retiring, one per step (the newest
  registration of a step a restarted trainer published again). Requests may name only
  these: the API server resolves ``<name>`` and ``<name>@<step>`` among them
  (:meth:`KeptVersions.report`, ``deltasync_lora_versions``), and the engine core fails a request
  it is handed for any other of our adapter ids when it is added (:meth:`admits`): the API's
  view of the versions may be a moment old;
- **room**: a switch adds a version; when that would hold more than ``versions_kept``, the
  oldest ones are *retiring* first (no longer servable: no new request can name them), and
  the switch waits until they are removed (:meth:`room`);
- **retire**: a retiring version (or one no rank reports as newest any more that is beyond
  the bound) is removed from every rank (``deltasync_retire``) at the first tick no request,
  running or waiting, uses it. A request running across a switch so finishes on its
  version, and adapter memory stays bounded by ``versions_kept`` per adapter.

Everything runs on the engine core's busy-loop thread, where requests are added: a request
added before a version starts retiring holds it until it finishes; one added after is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_deltasync.server.engine.handle import EngineCore
from vllm_deltasync.server.messages import TargetStatus
from vllm_deltasync.server.targets import ADAPTER_IDS, Target, adapter_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kept:
    """One version every rank holds."""

    step: int
    adapter: int
    """vLLM's adapter id."""
    identity: str | None


def common(statuses: Sequence[TargetStatus]) -> list[Kept]:
    """The versions every rank holds, in the first rank's order (oldest first)."""
    if not statuses:
        return []
    held = [set(s.versions) for s in statuses[1:]]
    return [Kept(*v) for v in statuses[0].versions if all(v in h for h in held)]


def is_ours(adapter: int) -> bool:
    """An adapter id of a followed version (``targets.adapter_id``)."""
    lo, hi = ADAPTER_IDS
    return lo <= adapter < hi


class KeptVersions:
    """The versions of one target on one engine (module doc)."""

    def __init__(self, engine: EngineCore, target: Target) -> None:
        assert target.policy.versions_kept is not None
        self.engine = engine
        self.name = target.name
        self.kept = target.policy.versions_kept
        self.retiring: set[int] = set()
        """Adapter ids no longer servable, removed at the first tick no request uses them."""
        self.held: list[Kept] = []
        """The versions every rank held at the last tick."""
        self.waited_on: int | None = None
        """The step of a retiring version a switch waits for (logged once per step)."""

    def servable(self) -> list[Kept]:
        """The versions requests may use, oldest first, one per step (module doc)."""
        by_step: dict[int, Kept] = {}
        for v in self.held:
            if v.adapter not in self.retiring:
                by_step.pop(v.step, None)
                by_step[v.step] = v  # a later registration of the same step wins
        return sorted(by_step.values(), key=lambda v: self.held.index(v))

    def admits(self, adapter: int) -> bool:
        """A request naming ``adapter`` may be added (one of this target's servable ids)."""
        return any(v.adapter == adapter for v in self.servable())

    def tick(self, statuses: Sequence[TargetStatus]) -> list[TargetStatus] | None:
        """Each tick: note what every rank holds; versions beyond the bound and shadowed ones
        start retiring; retiring ones no request uses are removed from every rank. The ranks'
        statuses after a removal (None when nothing was removed)."""
        self.held = common(statuses)
        servable = self.servable()
        shadowed = {v.adapter for v in self.held} - {v.adapter for v in servable}
        excess = servable[:max(0, len(servable) - self.kept)]
        self.retiring |= shadowed | {v.adapter for v in excess}
        self.retiring &= {a for s in statuses for _, a, _ in s.versions}
        return self._retire_unused()

    def room(self) -> bool:
        """Before a switch (it registers one more version): True when the ranks then hold at
        most ``versions_kept``. Else the oldest start retiring (no new request may name
        them), those no request uses are removed now, and the switch waits for the others'
        requests to finish."""
        over = len(self.held) + 1 - self.kept
        if over > 0:
            retiring = [v for v in self.held if v.adapter in self.retiring]
            rest = [v for v in self.held if v.adapter not in self.retiring]
            self.retiring |= {v.adapter for v in (retiring + rest)[:over]}
            self._retire_unused()
        if len(self.held) + 1 <= self.kept:
            self.waited_on = None
            return True
        busy = next(v for v in self.held if v.adapter in self.retiring)
        if self.waited_on != busy.step:
            self.waited_on = busy.step
            logger.info("deltasync %s: the next version waits for the requests on step %d to "
                        "finish (lora_versions_kept=%d; no new request may name it)", self.name,
                        busy.step, self.kept)
        return False

    def switched(self, step: int, identity: str | None) -> None:
        """A switch to ``step`` stood: every rank registered its version (``adapter_id`` of
        it), servable from now on, before the next tick reads the ranks' statuses again."""
        version = Kept(step, adapter_id(self.name, step, identity), identity)
        if version not in self.held:
            self.held.append(version)

    def _retire_unused(self) -> list[TargetStatus] | None:
        """Remove the retiring versions no request uses; the ranks' statuses after."""
        held = {v.adapter for v in self.held}
        due = sorted(a for a in self.retiring if a in held)
        if not due:
            return None
        used = self.engine.lora_ids_in_use()
        free = [a for a in due if a not in used]
        if not free:
            return None
        raw = list(self.engine.collective_rpc("deltasync_retire", args=(free,),
                                              kwargs={"model": self.name}))
        statuses = [TargetStatus.from_wire(r, f"deltasync_retire[{self.name!r}]") for r in raw]
        self.held = common(statuses)
        self.retiring &= {v.adapter for v in self.held}
        return statuses

    def report(self, statuses: Sequence[TargetStatus]) -> dict[str, Any]:
        """What the API server resolves requests with (``deltasync_lora_versions``)."""
        refused = next((s.refused for s in statuses if s.refused), None)
        error = next((s.last_error for s in statuses if s.last_error), None)
        return {"versions": [[v.step, v.adapter, v.identity] for v in self.servable()],
                "retiring": sorted(self.retiring), "refused": refused, "error": error}


__all__ = ["Kept", "KeptVersions", "common", "is_ours"]
