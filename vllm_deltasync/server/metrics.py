"""Every Prometheus metric of vllm-deltasync, and how they get out of the engine.

Where the numbers come from
---------------------------
Workers (one process per tensor-parallel rank) download, stage and apply steps; the engine
core gathers one status dict per rank every poll interval with
``collective_rpc("deltasync_status")``. The metrics live in the **engine core**: it turns those
dicts into Prometheus series (one series per rank, label ``rank``) and serves them. Nothing here
imports vLLM.

Glue for the extension (all of it)
----------------------------------
Worker side (each followed target on each rank: ``server/worker/target.py``)::

    stats = metrics.WorkerStats()
    stats.add_download("delta", nbytes, seconds)   # per downloaded step ("anchor" or "delta")
    stats.add_apply("delta", seconds, changed)     # per applied step; changed = elements written
    stats.add_failure("download", exc)             # stage: discover|download|verify|decode|stage|apply
    TargetStatus(..., counters=stats.snapshot(store.stats))   # server/messages.py

Engine-core side (the coordinator)::

    sync_metrics = metrics.SyncMetrics(bucket_url=cfg.url, format_version=SCHEMA_VERSION)
    server = sync_metrics.start_server(cfg.metrics_port)  # None when the port is 0 (off)
    every tick:     sync_metrics.update(parse_statuses(engine.collective_rpc("deltasync_status")))
    at each switch: sync_metrics.observe_switch(step, pause_s)
    at shutdown:    server.close() if server else None

Exposure
--------
* Own port (default ``metrics_port`` 9464): ``GET /metrics`` (Prometheus text) and
  ``GET /synced?max_steps_behind=N`` (JSON; 200 when every rank has applied a step and is at
  most N steps behind, no rank is on a branch the bucket no longer continues, and the engine
  core's switch loop is not failing, else 503: the
  readiness probe). Works for a plain ``vllm serve``.
* vLLM's own ``/metrics``: start the server with ``PROMETHEUS_MULTIPROC_DIR`` set to an empty
  directory. prometheus_client then keeps these values in files that vLLM's API server
  collects; gauges use ``livemostrecent`` so no ``pid`` label appears.
* Tensor parallel: per-rank series carry ``rank``; engine-wide series (pause, switches) do not.
  A replica's staleness is ``max by (instance) (deltasync_steps_behind{model="policy"})``.
* Speculative drafter: every per-rank series carries ``model`` (``policy``, or ``drafter`` for
  the draft model following ``drafter_url``, read from the ``"drafter"`` entry of the rank's
  status). A drafter that cannot follow shows ``deltasync_failing{model="drafter"} 1``.

Counters in ``counters`` are cumulative since the worker started; :class:`SyncMetrics` turns
them into increments (a new ``epoch`` means the worker restarted). Durations travel as
numbered events so several readers of ``deltasync_status`` never lose or double-count one.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_deltasync._urls import redact_text, redact_url
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.server.messages import Counters, RankStatus, TargetStatus
from vllm_deltasync.server.targets import TARGETS, names

if TYPE_CHECKING:
    from vllm_deltasync.server.endpoint import MetricsServer

PREFIX = "deltasync"
STAGES = ("discover", "download", "verify", "decode", "stage", "apply")
KINDS = ("anchor", "delta")
_OUTCOMES = ("ok", "error", "rate_limited")
_DOWNLOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_BEHIND_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50, 100)
CONFLICT_REASONS = ("min_timeout", "exact_behind", "exact_passed", "exact_switched")
"""Why a request was answered 409 (label ``reason`` of ``deltasync_version_conflicts_total``)."""
_APPLY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_MAX_EVENTS = 1024


MODELS = names()
"""Label ``model`` of every per-rank series: the followed target's name (``server/targets.py``):
the served policy, or the speculative drafter that follows its own bucket (``drafter_url``)."""
_R = ("model", "rank")
#: (attribute, name without prefix, help, labels) of every gauge.
_GAUGES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("applied_step", "applied_step", "Step the rank's live weights are at (-1: none yet).", _R),
    ("staged_step", "staged_step", "Newest step staged on the rank, ready to apply (-1: none).", _R),
    ("newest_step", "newest_step", "Newest committed step the rank saw in the bucket (-1: none).", _R),
    ("steps_behind", "steps_behind",
     "newest_step - applied_step (newest_step + 1 before the first apply).", _R),
    ("applied_publish_ts", "applied_publish_timestamp_seconds",
     "When the trainer published the applied step (unix seconds).", _R),
    ("newest_publish_ts", "newest_publish_timestamp_seconds",
     "When the trainer published the newest seen step (unix seconds).", _R),
    ("last_discovery_ts", "last_discovery_timestamp_seconds",
     "Last successful look at the bucket (unix seconds).", _R),
    ("staged_bytes", "staged_bytes", "Bytes held in host staging buffers.", _R),
    ("failing", "failing", "1 while the rank's last attempt failed (last_error set), else 0.", _R),
    ("branch_lost", "branch_lost",
     "1 while the rank's applied step is on a branch the bucket no longer continues (a trainer "
     "restart, another writer, a wiped bucket), until an anchor of the bucket's chain applies.",
     _R),
    ("last_failure_ts", "last_failure_timestamp_seconds",
     "When the engine core first saw the rank's current error, by error class (unix seconds).",
     ("model", "rank", "reason")),
    ("status_ts", "status_timestamp_seconds",
     "Last time the engine core gathered every rank's status (unix seconds).", ()),
    ("last_switch_ts", "last_switch_timestamp_seconds",
     "When the engine last switched weights (unix seconds).", ()),
    ("bucket_info", "bucket_info",
     "The followed bucket (URL without credentials) and format version; value 1.",
     ("url", "format_version")),
    ("coordinator_failing", "coordinator_failing",
     "1 while the engine core's switch loop has failed several ticks in a row, else 0.", ()),
)
#: (attribute, name without prefix and ``_total``, help, labels) of every counter.
_COUNTERS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("downloaded_bytes", "downloaded_bytes", "Bytes of step data downloaded by the rank.",
     ("model", "rank", "kind")),
    ("applied_steps", "applied_steps", "Steps applied by the rank.", ("model", "rank", "kind")),
    ("changed_elements", "changed_elements", "Parameter elements written by the rank.", _R),
    ("branch_changes", "branch_changes",
     "Branch changes seen by the rank: its applied step gone from the bucket's chain (see "
     "branch_lost), or a restarted trainer's anchor replacing steps after its checkpoint.", _R),
    ("failures", "failures", "Failed attempts by stage and error class.",
     ("model", "rank", "stage", "reason")),
    ("store_requests", "store_requests",
     "Bucket requests by operation and outcome (rate_limited: HTTP 429).",
     ("model", "rank", "operation", "outcome")),
    ("mirror_requests", "mirror_requests",
     "Reads of data objects tried on a mirror (mirror_urls) by outcome: ok, not_found, error, "
     "timeout, slow (below the rate floor), corrupt (bytes that failed their sha256); a "
     "failing mirror is skipped for a while and the bucket serves.",
     ("model", "rank", "mirror", "outcome")),
    ("switches", "switches", "Weight switches performed by the engine.", ()),
    ("coordinator_failures", "coordinator_failures",
     "Engine-core ticks that failed (a switch taken back by the engine core, a status poll that "
     "raised); the error is in the log and /synced.", ()),
    ("version_conflicts", "version_conflicts",
     "HTTP requests answered 409 because the weights they demanded were not served, by reason: "
     "min_timeout (X-Min-Weight-Version not reached in min_version_wait_s), exact_behind / "
     "exact_passed (X-Exact-Weight-Version newer / older than the applied step), "
     "exact_switched (a switch happened while an exact request ran).", ("reason",)),
)
#: (attribute, name without prefix, help, labels, buckets) of every histogram.
_HISTOGRAMS: tuple[tuple[str, str, str, tuple[str, ...], tuple[float, ...]], ...] = (
    ("download_duration", "download_duration_seconds",
     "Time to download and verify one step's files on the rank.", _R, _DOWNLOAD_BUCKETS),
    ("apply_duration", "apply_duration_seconds",
     "Time one rank spent writing one step into its weights.", _R, _APPLY_BUCKETS),
    ("pause_duration", "pause_duration_seconds",
     "Engine pause for one switch (every rank applies the step).", (), _APPLY_BUCKETS),
    ("admission_steps_behind", "admission_steps_behind",
     "Per request added to the engine: how many steps the applied weights were behind the "
     "newest step any rank saw in the bucket (newest + 1 before the first apply).", (),
     _BEHIND_BUCKETS),
)


def _redacted(text: Any) -> Any:
    """``/synced`` serves errors as they are, with every URL in them redacted (a second line
    of defence: the poller redacts what it reports)."""
    return redact_text(text) if isinstance(text, str) else text


def error_reason(error: BaseException | str | None) -> str:
    """A bounded label value for an error: its class name (``"ChainError"``)."""
    if error is None:
        return ""
    if isinstance(error, BaseException):
        return type(error).__name__
    head = str(error).split(":", 1)[0].strip()
    return head if head.isidentifier() else "Error"


class WorkerStats:
    """Cumulative counters one rank keeps; :meth:`snapshot` goes into its status dict.

    Thread-safe: the poller thread records, the worker's main thread snapshots.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = os.urandom(8).hex()
        self._seq = itertools.count(1)
        self._bytes = dict.fromkeys(KINDS, 0)
        self._applied = dict.fromkeys(KINDS, 0)
        self._changed = 0
        self._branch_changes = 0
        self._failures: dict[tuple[str, str], int] = {}
        self._events: collections.deque[tuple[int, str, float]] = collections.deque(
            maxlen=_MAX_EVENTS
        )

    def add_download(self, kind: str, nbytes: int, seconds: float) -> None:
        """One step's files downloaded for this rank (``kind`` is ``anchor`` or ``delta``)."""
        _check_kind(kind)
        with self._lock:
            self._bytes[kind] += int(nbytes)
            self._events.append((next(self._seq), "download", float(seconds)))

    def add_apply(self, kind: str, seconds: float, changed_elements: int) -> None:
        """One step applied on this rank: time spent writing, elements written."""
        _check_kind(kind)
        with self._lock:
            self._applied[kind] += 1
            self._changed += int(changed_elements)
            self._events.append((next(self._seq), "apply", float(seconds)))

    def add_branch_change(self) -> None:
        """The rank found its applied step on a branch the bucket no longer continues."""
        with self._lock:
            self._branch_changes += 1

    def add_failure(self, stage: str, error: BaseException | str) -> None:
        """A failed attempt at ``stage`` (one of :data:`STAGES`); the reason is the error class."""
        if stage not in STAGES:
            raise ConfigError(f"failure stage {stage!r} is not one of {', '.join(STAGES)}")
        key = (stage, error_reason(error))
        with self._lock:
            self._failures[key] = self._failures.get(key, 0) + 1

    def snapshot(self, store_stats: Any = None) -> Counters:
        """The totals so far (``store_stats``: the bucket store's request counters)."""
        requests = getattr(store_stats, "requests", None) or {}
        mirrors = getattr(store_stats, "mirror_requests", None) or {}
        with self._lock:
            return Counters(
                epoch=self._epoch, downloaded_bytes=dict(self._bytes),
                applied_steps=dict(self._applied), changed_elements=self._changed,
                branch_changes=self._branch_changes,
                failures=tuple((s, r, n) for (s, r), n in sorted(self._failures.items())),
                events=tuple(self._events),
                store_requests=tuple((op, out, n) for (op, out), n in sorted(requests.items())),
                store_bytes_read=int(getattr(store_stats, "bytes_read", 0) or 0),
                mirror_requests=tuple((m, out, n) for (m, out), n in sorted(mirrors.items())))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ConfigError(f"step kind {kind!r} is not one of {', '.join(KINDS)}")


class _RankCursor:
    """What the engine core has already counted from one rank."""

    def __init__(self, epoch: str) -> None:
        self.epoch = epoch
        self.last_event = 0
        self.seen: dict[tuple[str, ...], float] = {}

    def advance(self, key: tuple[str, ...], total: float) -> float:
        """Increment since the last snapshot (the whole total after a restart)."""
        previous = self.seen.get(key, 0.0)
        self.seen[key] = total
        return total - previous if total >= previous else total


class SyncMetrics:
    """The metric objects, fed from per-rank status dicts in the engine core."""

    applied_step: Gauge
    staged_step: Gauge
    newest_step: Gauge
    steps_behind: Gauge
    applied_publish_ts: Gauge
    newest_publish_ts: Gauge
    last_discovery_ts: Gauge
    staged_bytes: Gauge
    failing: Gauge
    branch_lost: Gauge
    last_failure_ts: Gauge
    status_ts: Gauge
    last_switch_ts: Gauge
    bucket_info: Gauge
    coordinator_failing: Gauge
    downloaded_bytes: Counter
    applied_steps: Counter
    changed_elements: Counter
    branch_changes: Counter
    failures: Counter
    store_requests: Counter
    mirror_requests: Counter
    switches: Counter
    coordinator_failures: Counter
    download_duration: Histogram
    apply_duration: Histogram
    pause_duration: Histogram
    admission_steps_behind: Histogram
    version_conflicts: Counter

    def __init__(
        self,
        *,
        bucket_url: str = "",
        format_version: int | str = "",
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._cursors: dict[tuple[str, str], _RankCursor] = {}
        self._errors: dict[tuple[str, str], str] = {}
        self.latest: list[RankStatus] = []
        self._coordinator: dict[str, Any] = {"failing": False, "last_error": None}
        self._build(self.registry)
        self.coordinator_failing.set(0)
        for reason in CONFLICT_REASONS:  # exported at 0, so rate() answers before the first 409
            self.version_conflicts.labels(reason)
        if bucket_url:
            self.bucket_info.labels(redact_url(bucket_url), str(format_version)).set(1)

    def _build(self, r: CollectorRegistry) -> None:
        for attr, name, doc, labels in _GAUGES:
            metric = Gauge(f"{PREFIX}_{name}", doc, labels, registry=r,
                           multiprocess_mode="livemostrecent")
            setattr(self, attr, metric)
        for attr, name, doc, labels in _COUNTERS:
            setattr(self, attr, Counter(f"{PREFIX}_{name}", doc, labels, registry=r))
        for attr, name, doc, labels, buckets in _HISTOGRAMS:
            setattr(self, attr, Histogram(f"{PREFIX}_{name}", doc, labels, registry=r,
                                          buckets=buckets))

    def update(self, ranks: Sequence[RankStatus], *, now: float | None = None) -> None:
        """Take every rank's status (each followed target's series under its ``model``)."""
        now = time.time() if now is None else now
        with self._lock:
            for r in ranks:
                for name, status in r.targets.items():
                    self._update_model(name, str(status.rank), status, now)
            self.latest = list(ranks)
            self.status_ts.set(now)

    def observe_switch(self, step: int, pause_s: float, *, now: float | None = None) -> None:
        """The engine switched every rank to ``step``, pausing generation ``pause_s`` seconds."""
        del step  # the step is a gauge per rank (applied_step), never a label
        self.switches.inc()
        self.pause_duration.observe(pause_s)
        self.last_switch_ts.set(time.time() if now is None else now)

    def observe_admission(self, steps_behind: int) -> None:
        """A request was added to the engine while it served ``steps_behind`` steps behind."""
        self.admission_steps_behind.observe(max(int(steps_behind), 0))

    def count_conflict(self, reason: str) -> None:
        """The API server answered a request 409 (:data:`CONFLICT_REASONS`)."""
        if reason in CONFLICT_REASONS:
            self.version_conflicts.labels(reason).inc()

    def coordinator_state(self, *, failing: bool, error: BaseException | None = None) -> None:
        """After each engine-core tick: ``error`` when it failed (counted by class), ``failing``
        once it failed several in a row (then ``/synced`` answers 503)."""
        with self._lock:
            if error is not None:
                self.coordinator_failures.inc()
                self._coordinator["last_error"] = redact_text(f"{error_reason(error)}: {error}")
            elif not failing:
                self._coordinator["last_error"] = None
            self._coordinator["failing"] = failing
            self.coordinator_failing.set(1 if failing else 0)

    def _update_model(self, model: str, rank: str, s: TargetStatus, now: float) -> None:
        self._update_gauges((model, rank), s, now)
        if s.counters is not None:
            self._update_counters((model, rank), s.counters)

    def _update_gauges(self, who: tuple[str, str], s: TargetStatus, now: float) -> None:
        applied, newest, staged = s.applied_step, s.newest_step, s.staged_step
        self.applied_step.labels(*who).set(-1 if applied is None else applied)
        self.staged_step.labels(*who).set(-1 if staged is None else staged)
        self.newest_step.labels(*who).set(-1 if newest is None else newest)
        self.steps_behind.labels(*who).set(_behind(s))
        for value, gauge in (
            (s.applied_published_at, self.applied_publish_ts),
            (s.newest_published_at, self.newest_publish_ts),
            (s.last_discovery_at, self.last_discovery_ts),
            (s.staged_bytes, self.staged_bytes),
        ):
            if value is not None and not math.isnan(float(value)):
                gauge.labels(*who).set(float(value))
        self.branch_lost.labels(*who).set(1 if s.branch_lost else 0)
        error = str(s.last_error or s.refused or "")
        self.failing.labels(*who).set(1 if error else 0)
        if error and self._errors.get(who) != error:
            self.last_failure_ts.labels(*who, error_reason(error)).set(now)
        self._errors[who] = error

    def _update_counters(self, who: tuple[str, str], c: Counters) -> None:
        cursor = self._cursors.get(who)
        if cursor is None or cursor.epoch != c.epoch:
            cursor = self._cursors[who] = _RankCursor(c.epoch)
        for kind, total in c.downloaded_bytes.items():
            _inc(self.downloaded_bytes.labels(*who, kind), cursor.advance(("b", kind), total))
        for kind, total in c.applied_steps.items():
            _inc(self.applied_steps.labels(*who, kind), cursor.advance(("a", kind), total))
        _inc(self.changed_elements.labels(*who), cursor.advance(("c",), c.changed_elements))
        _inc(self.branch_changes.labels(*who), cursor.advance(("g",), c.branch_changes))
        for stage, reason, total in c.failures:
            _inc(self.failures.labels(*who, stage, reason), cursor.advance(("f", stage, reason), total))
        for op, outcome, total in c.store_requests:
            for known in _OUTCOMES:  # zero series, so rate(...{outcome="rate_limited"}) has data
                self.store_requests.labels(*who, op, known)
            key = ("r", op, outcome)
            _inc(self.store_requests.labels(*who, op, outcome), cursor.advance(key, total))
        for mirror, outcome, total in c.mirror_requests:
            labels = (*who, redact_url(str(mirror)), str(outcome))
            _inc(self.mirror_requests.labels(*labels), cursor.advance(("m", *labels[2:]), total))
        for seq, kind, seconds in c.events:
            if seq <= cursor.last_event:
                continue
            cursor.last_event = seq
            hist = self.download_duration if kind == "download" else self.apply_duration
            hist.labels(*who).observe(seconds)

    def synced(self, max_steps_behind: int = 0) -> tuple[bool, dict[str, Any]]:
        """Readiness: every rank is at most ``max_steps_behind`` steps behind the newest step of
        the primary target it saw, and has applied one (unless the bucket is empty). Every
        other followed target is shown under its name with ``<name>_synced``, never a reason
        for 503 (a stale or broken draft changes how fast tokens come, not which)."""
        with self._lock:
            ranks = list(self.latest)
            coordinator = dict(self._coordinator)
        primary = TARGETS[0].name
        rows = [_row(r.targets[primary]) for r in ranks if primary in r.targets]
        ok = bool(rows) and not coordinator["failing"] and all(
            _current(r, max_steps_behind) and not r["branch_lost"] for r in rows)
        body: dict[str, Any] = {"synced": ok, "max_steps_behind": max_steps_behind,
                                "ranks": rows, "coordinator": coordinator}
        for name in dict.fromkeys(n for r in ranks for n in r.targets if n != primary):
            others = [_row(s) for r in ranks if (s := r.of(name)) is not None]
            body[name] = others
            body[f"{name}_synced"] = _others_synced(others, max_steps_behind)
        return ok, body

    def synced_target(self, model: str, max_steps_behind: int = 0
                      ) -> tuple[bool, dict[str, Any]] | None:
        """``/synced?model=<name>``: the readiness of one followed target (a LoRA adapter, the
        drafter): every rank follows it, without a refusal or an error, at most
        ``max_steps_behind`` behind; None when this server follows no such target."""
        with self._lock:
            ranks = list(self.latest)
        rows = [_row(s) for r in ranks if (s := r.of(model)) is not None]
        if not rows:
            return None
        ok = _others_synced(rows, max_steps_behind)
        return ok, {"model": model, "synced": ok, "max_steps_behind": max_steps_behind,
                    "ranks": rows}

    def start_server(self, port: int, addr: str = "0.0.0.0") -> MetricsServer | None:
        """Serve ``/metrics`` and ``/synced`` on ``port``; ``0`` means off and returns None."""
        from vllm_deltasync.server.endpoint import MetricsServer

        return None if port == 0 else MetricsServer(self, port=port, addr=addr)


def _behind(s: TargetStatus) -> int:
    newest, applied = s.newest_step, s.applied_step
    return 0 if newest is None else max(newest - (-1 if applied is None else applied), 0)


def _row(s: TargetStatus) -> dict[str, Any]:
    return {"rank": s.rank, "applied_step": s.applied_step, "newest_step": s.newest_step,
            "steps_behind": _behind(s), "branch_lost": _redacted(s.branch_lost),
            "refused": _redacted(s.refused), "last_error": _redacted(s.last_error)}


def _others_synced(rows: list[dict[str, Any]], max_steps_behind: int) -> bool:
    return all(r["refused"] is None and r["last_error"] is None
               and _current(r, max_steps_behind) for r in rows)


def _current(row: Mapping[str, Any], max_steps_behind: int) -> bool:
    """Applied a step (an empty bucket leaves the loaded weights current) and not too far behind."""
    return ((row["applied_step"] is not None or row["newest_step"] is None)
            and row["steps_behind"] <= max_steps_behind)


def _inc(child: Any, amount: float) -> None:
    if amount > 0:
        child.inc(amount)


__all__ = ["CONFLICT_REASONS", "KINDS", "MODELS", "PREFIX", "STAGES", "SyncMetrics", "WorkerStats",
           "error_reason"]
