"""``vllm-deltasync status URL...``: one line per rollout server, read from its metrics endpoint.

::

    $ vllm-deltasync status http://rollout-0:9464 http://rollout-1:9464
    http://rollout-0:9464/metrics  applied=41 newest=42 behind=1 lag=3.2s ranks=2 error=-
    http://rollout-1:9464/metrics  applied=42 newest=42 behind=0 lag=0.0s ranks=2 error=-

A URL without a path gets ``/metrics``; one without a scheme gets ``http://``. The metrics
endpoint takes no credentials: an argument with an ``@`` in it (``user:password@host``, in any
spelling: ``http://user:pa/ss@host``) is refused before anything is looked up or sent, in one
line that shows none of it (``vllm_deltasync._urls``: a secret never reaches a host name
lookup); so is a bucket URL (``s3:...``) given by mistake. A replica with
tensor parallelism reports one series per rank: the line shows its worst rank (lowest applied
step, most steps behind) and the error of a rank whose last attempt failed
(``error=IntegrityError@rank1``), and ``branch=lost@rank0`` while a rank's applied step left the
bucket's chain (a trainer restart that reused step numbers, a wiped bucket: it resyncs through
the newest anchor). A server whose speculative drafter follows its own bucket adds
``drafter=applied:N,behind:M,error:-`` (series with ``model="drafter"``); a drafter's failure
is shown and never changes the exit status (a draft changes speed, not tokens). Exit status: 0 all fine, 1 a server unreachable or exposing no deltasync
metrics, 3 a replica failing, on a lost branch, or more than ``--max-steps-behind`` steps
behind.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from vllm_deltasync._urls import (
    KNOWN_SCHEMES,
    credential_refusal,
    redact_text,
    redact_url,
    shown_scheme,
)
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.server.targets import TARGETS

_MAX_METRICS_BYTES = 16 << 20
EXIT_UNREACHABLE = 1
EXIT_UNHEALTHY = 3


@dataclass(frozen=True)
class ReplicaStatus:
    """What one server's metrics say (None where the server did not say)."""

    url: str
    applied_step: int | None = None
    newest_step: int | None = None
    steps_behind: int | None = None
    seconds_behind: float | None = None
    ranks: int = 0
    error: str | None = None
    """``<reason>@rank<N>`` of a failing rank, None when no rank is failing."""
    branch_lost: str | None = None
    """``rank<N>`` of a rank whose applied step left the bucket's chain (resyncing), else None."""
    unreachable: str | None = None
    """Why the metrics could not be read; the other fields are then empty."""
    others: dict[str, str] = field(default_factory=dict)
    """Each other followed target with series (the speculative drafter: ``drafter``; each LoRA
    adapter under its name), by its ``model`` label: ``applied:N,behind:M,error:<reason>@rank<N>``
    of its worst rank."""

    def to_json(self) -> dict[str, Any]:
        """The row, each other target under its name (the drafter: None without series)."""
        out = {k: v for k, v in asdict(self).items() if k != "others"}
        out.update({t.name: None for t in TARGETS[1:]})
        out.update(self.others)
        return out

    def line(self) -> str:
        if self.unreachable is not None:
            return f"{self.url}  unreachable: {self.unreachable}"
        lag = "-" if self.seconds_behind is None else f"{self.seconds_behind:.1f}s"
        return (f"{self.url}  applied={_show(self.applied_step)} newest={_show(self.newest_step)} "
                f"behind={_show(self.steps_behind)} lag={lag} ranks={self.ranks} "
                f"error={self.error or '-'}"
                + (f" branch=lost@{self.branch_lost}" if self.branch_lost else "")
                + "".join(f" {name}={value}" for name, value in self.others.items()))


def _show(value: int | None) -> str:
    return "-" if value is None or value < 0 else str(value)


def metrics_url(url: str) -> str:
    """``host:9464`` -> ``http://host:9464/metrics``; a URL with a path is kept. Refused
    (ConfigError, nothing looked up): an ``@`` anywhere (a credential in some spelling: the
    endpoint takes none), a known non-http scheme (``s3:/K:S@b``, ``s3://b``)."""
    if "@" in url:
        raise credential_refusal(url, "status: URL", "the metrics endpoint takes no credentials; "
                                 "use host:port or http://host:port/metrics")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if "://" not in url and scheme in KNOWN_SCHEMES and not _is_port(url.split(":", 1)[1]):
        raise ConfigError(f"status: URL {shown_scheme(url)} is not an http(s) URL of a metrics "
                          "endpoint; use host:port or http://host:port/metrics")
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urllib.parse.urlsplit(url)
        host, _ = parts.hostname, parts.port
    except ValueError:
        raise ConfigError(f"status: {redact_url(url)!r} is not a valid URL (host or port); "
                          "use host:port or http://host:port/metrics") from None
    if parts.scheme not in ("http", "https") or not host:
        raise ConfigError(f"status: {redact_url(url)!r} is not an http(s) URL of a metrics endpoint")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


def _is_port(text: str) -> bool:
    """``9464`` or ``9464/metrics``: what follows ``host:`` in ``s3:9464`` (a host named s3)."""
    port = text.split("/", 1)[0]
    return port.isascii() and port.isdigit()


def parse_status(url: str, text: str) -> ReplicaStatus:
    """Summarize one exposition (Prometheus text format) of a replica."""
    primary = TARGETS[0].name
    per_model: dict[str, dict[str, dict[str, float]]] = {t.name: {} for t in TARGETS}
    failures: dict[str, dict[str, tuple[float, str]]] = {t.name: {} for t in TARGETS}
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except Exception:  # noqa: BLE001 - HTML, garbage: whatever the parser chokes on
        return ReplicaStatus(url, unreachable="not a Prometheus metrics endpoint (unparsable answer)")
    for s in samples:
        rank = s.labels.get("rank")
        model = s.labels.get("model", primary)  # servers before the drafter had no model label
        if rank is None or not s.name.startswith("deltasync_"):
            continue
        if model not in per_model:  # a LoRA adapter, by its name
            per_model[model], failures[model] = {}, {}
        if s.name == "deltasync_last_failure_timestamp_seconds":
            if s.value > failures[model].get(rank, (-1.0, ""))[0]:
                failures[model][rank] = (s.value, s.labels.get("reason", "Error"))
        elif set(s.labels) <= {"rank", "model"}:
            per_model[model].setdefault(rank, {})[s.name[len("deltasync_"):]] = s.value
    if not per_model[primary]:
        return ReplicaStatus(url, unreachable="no deltasync metrics at this URL")
    row = _summarize(url, per_model[primary], failures[primary])
    for name in [m for m in per_model if m != primary]:
        if per_model[name]:
            d = _summarize(url, per_model[name], failures[name])
            row.others[name] = (f"applied:{_show(d.applied_step)},"
                                f"behind:{_show(d.steps_behind)},error:{d.error or '-'}")
    return row


def _summarize(url: str, per_rank: dict[str, dict[str, float]],
               failures: dict[str, tuple[float, str]]) -> ReplicaStatus:
    def values(key: str) -> list[float]:
        return [r[key] for r in per_rank.values() if key in r]

    applied, newest, behind = values("applied_step"), values("newest_step"), values("steps_behind")
    lags = [r["newest_publish_timestamp_seconds"] - r["applied_publish_timestamp_seconds"]
            for r in per_rank.values()
            if {"newest_publish_timestamp_seconds", "applied_publish_timestamp_seconds"} <= set(r)]
    failing = sorted(rank for rank, r in per_rank.items() if r.get("failing", 0) > 0)
    lost = sorted(rank for rank, r in per_rank.items() if r.get("branch_lost", 0) > 0)
    error = None
    if failing:
        rank = failing[0]
        error = f"{failures.get(rank, (0.0, 'Error'))[1]}@rank{rank}"
    return ReplicaStatus(
        url,
        applied_step=int(min(applied)) if applied else None,
        newest_step=int(max(newest)) if newest else None,
        steps_behind=int(max(behind)) if behind else None,
        seconds_behind=max(lags) if lags else None,
        ranks=len(per_rank),
        error=error,
        branch_lost=f"rank{lost[0]}" if lost else None,
    )


def fetch_status(url: str, timeout_s: float = 5.0) -> ReplicaStatus:
    """GET one metrics endpoint and summarize it (never raises for network errors)."""
    target = metrics_url(url)
    shown = redact_url(target)
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as resp:
            text = resp.read(_MAX_METRICS_BYTES + 1).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return ReplicaStatus(shown, unreachable=redact_text(str(reason)))
    except Exception as exc:  # noqa: BLE001 - a bad status line or header: one line, no traceback
        return ReplicaStatus(shown, unreachable=f"bad HTTP answer ({type(exc).__name__})")
    if len(text) > _MAX_METRICS_BYTES:
        return ReplicaStatus(shown, unreachable="answer larger than 16 MiB: not our metrics endpoint")
    return parse_status(shown, text)


def fetch_all(urls: Iterable[str], timeout_s: float = 5.0) -> list[ReplicaStatus]:
    """Every server at once; results in the order of ``urls``."""
    urls = [metrics_url(u) for u in urls]
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(urls)))) as pool:
        return list(pool.map(lambda u: fetch_status(u, timeout_s), urls))


def exit_status(rows: Sequence[ReplicaStatus], max_steps_behind: int | None) -> int:
    if any(r.unreachable is not None for r in rows):
        return EXIT_UNREACHABLE
    for r in rows:
        too_far = max_steps_behind is not None and (r.steps_behind or 0) > max_steps_behind
        if r.error is not None or r.branch_lost is not None or too_far:
            return EXIT_UNHEALTHY
    return 0


def add_parser(subparsers: Any) -> None:
    """Register the ``status`` verb (called by :mod:`vllm_deltasync.cli`)."""
    p = subparsers.add_parser(
        "status", help="applied step, steps behind and last error of running rollout servers",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("urls", nargs="+", metavar="URL",
                   help="metrics endpoint of a server (host:9464, http://host:9464/metrics)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per server (default 5)")
    p.add_argument("--max-steps-behind", type=int, default=None,
                   help="exit 3 when a replica is more steps behind than this")
    p.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print one line per server; the exit status says whether all are fine."""
    rows = fetch_all(args.urls, args.timeout)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
    else:
        for row in rows:
            print(row.line())
    sys.stdout.flush()
    return exit_status(rows, args.max_steps_behind)
