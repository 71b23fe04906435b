"""A real Prometheus scraping our exporter while a real publisher writes steps to a file:// bucket.

The ranks here are two bucket followers built from the real ``BucketReader`` (download, verify,
decode) writing into plain bf16 tensors, and a coordinator that switches both at once: the same
roles the extension's poller and engine core play, without vLLM. Their status dicts and
``WorkerStats`` feed ``SyncMetrics`` exactly as the engine core does; ``MetricsServer`` serves them
on loopback; Prometheus scrapes every second and evaluates the alert rules. Every expression of
the dashboard and of the rules is then run through Prometheus' query API.

Rank 0 also carries a speculative drafter (a third follower of the same bucket, as a drafter
that is a copy of the policy would be), reported inside rank 0's status like the extension's:
its series carry ``model="drafter"`` and the policy's queries must not count it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.helpers.monitoring import DEPLOY, rank_status, scrape_config
from tests.helpers.net import http_get
from tests.helpers.waiting import wait_until
from vllm_deltasync import cli
from vllm_deltasync.errors import DeltaSyncError, FormatError, IntegrityError, StoreError
from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.server import metrics
from vllm_deltasync.server.endpoint import MetricsServer
from vllm_deltasync.server.messages import TargetStatus
from vllm_deltasync.trainer.publisher import DeltaPublisher

pytestmark = pytest.mark.prometheus
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "vllm-deltasync.json"
STEPS = 14
TICK_S = 0.2


class Follower:
    """One rank: discovers, downloads and stages steps; applies when told."""

    def __init__(self, rank: int, url: str, shapes: dict[str, tuple[int, ...]]) -> None:
        self.rank = rank
        self.reader = BucketReader.open(url)
        self.stats = metrics.WorkerStats()
        self.weights = {n: torch.zeros(s, dtype=torch.bfloat16).view(-1) for n, s in shapes.items()}
        self.applied: Manifest | None = None
        self.staged: list[tuple[Manifest, list[Any]]] = []
        self.newest: Manifest | None = None
        self.last_error: str | None = None
        self.last_discovery: float | None = None

    async def poll(self) -> None:
        try:
            latest = await self.reader.latest_step()
            self.last_discovery = time.time()
            if latest is None:
                return
            self.newest = await self.reader.manifest(latest)
            done = self.staged[-1][0].step if self.staged else self.applied and self.applied.step
            for m in await self.reader.plan(done, latest):
                self.staged.append((m, await self._download(m)))
            self.last_error = None
        except DeltaSyncError as exc:
            stage = ("verify" if isinstance(exc, IntegrityError) else "decode"
                     if isinstance(exc, FormatError) else "download"
                     if isinstance(exc, StoreError) else "discover")
            self.stats.add_failure(stage, exc)
            self.last_error = f"{type(exc).__name__}: {exc}"

    async def _download(self, m: Manifest) -> list[Any]:
        before, start = self.reader.store.stats.bytes_read, time.perf_counter()
        patches = [p async for p in self.reader.iter_patches(m)]
        self.stats.add_download(m.kind, self.reader.store.stats.bytes_read - before,
                                time.perf_counter() - start)
        return patches

    def apply_next(self) -> int:
        m, patches = self.staged.pop(0)
        start, changed = time.perf_counter(), 0
        for p in patches:
            flat = self.weights[p.name]
            if p.indices is None:
                flat[p.offset:p.offset + p.values.numel()] = p.values
            elif p.relative:  # int16 differences of bf16 bit patterns (sparse-v2), mod 2^16
                bits = flat.view(torch.int16)
                bits.index_copy_(0, p.indices, bits[p.indices] + p.values)
            else:
                flat.index_copy_(0, p.indices, p.values)
            changed += p.values.numel()
        self.stats.add_apply(m.kind, time.perf_counter() - start, changed)
        self.applied = m
        return m.step

    def status(self) -> dict[str, Any]:
        return {
            "applied_step": self.applied.step if self.applied else None,
            "staged_step": self.staged[-1][0].step if self.staged else None,
            "newest_step": self.newest.step if self.newest else None,
            "applied_published_at": self.applied.created_at if self.applied else None,
            "newest_published_at": self.newest.created_at if self.newest else None,
            "last_discovery_at": self.last_discovery,
            "staged_bytes": sum(p.values.numel() * 2 for _, ps in self.staged for p in ps),
            "last_error": self.last_error,
            "counters": self.stats.snapshot(self.reader.store.stats),
        }


class Coordinator(threading.Thread):
    """The engine core's role: every tick poll all ranks, switch when all staged, update metrics."""

    def __init__(self, ranks: list[Follower], sync_metrics: metrics.SyncMetrics,
                 drafter: Follower, adapter: Follower) -> None:
        super().__init__(daemon=True)
        self.ranks, self.metrics, self.drafter = ranks, sync_metrics, drafter
        self.adapter = adapter
        """A LoRA adapter's rank 0 (named ``math``: the dashboard's adapter row)."""
        self.running = threading.Event()
        self.running.set()
        self.stopped = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._loop())
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    async def _loop(self) -> None:
        while not self.stopped.is_set():
            if self.running.is_set():
                for r in [*self.ranks, self.drafter, self.adapter]:
                    await r.poll()
                while all(r.staged for r in self.ranks):
                    start = time.perf_counter()
                    steps = {r.apply_next() for r in self.ranks}
                    assert len(steps) == 1, steps
                    self.metrics.observe_switch(steps.pop(), time.perf_counter() - start)
                for other in (self.drafter, self.adapter):  # on their own, never holding
                    while other.staged:
                        other.apply_next()
                statuses = [rank_status(r.rank, **r.status()) for r in self.ranks]
                statuses[0] = rank_status(0, **self.ranks[0].status(),
                                          drafter=self.drafter.status())
                statuses[0].targets["math"] = TargetStatus(
                    **{"rank": 0, **self.adapter.status(), "model": "math"})
                self.metrics.update(statuses)
            await asyncio.sleep(TICK_S)
        for r in [*self.ranks, self.drafter, self.adapter]:
            await r.reader.close()


def instantiate(expr: str) -> str:
    """Grafana variables -> values Prometheus accepts."""
    return expr.replace("$__rate_interval", "2m").replace('"$instance"', '".*"')


def alert_lhs(expr: str) -> str:
    """``x > 4`` -> ``x``: the series an alert compares (healthy now, so the alert itself is empty)."""
    flat = " ".join(expr.split())
    match = re.fullmatch(r"(.+?)\s*(?:>|<|==|>=|<=)\s*[0-9.]+", flat)
    assert match, f"alert expression without a final threshold: {flat}"
    return match.group(1)


def trainer_steps(shapes: dict[str, tuple[int, ...]]) -> Any:
    """Real AdamW steps on fp32 master weights; yields the parameters after each step."""
    torch.manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(s) * 0.02) for n, s in shapes.items()}
    opt = torch.optim.AdamW(params.values(), lr=2e-4)
    for _ in range(STEPS):
        loss = sum((p * torch.randn_like(p)).sum() for p in params.values())
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        yield {n: p.detach() for n, p in params.items()}


def corrupt_next_step(bucket: Path, step: int) -> tuple[Path, bytes]:
    doc = json.loads((bucket / "manifests" / f"{step:012d}.json").read_text())
    path = bucket / doc["files"][0]["path"]
    original = path.read_bytes()
    path.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
    return path, original


def wait(predicate: Any, timeout: float = 30.0, what: str = "") -> None:
    wait_until(predicate, timeout, what, interval=0.05)


def cli_status(url: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["status", url])
    return code, out.getvalue()


def test_prometheus_scrapes_fleet_metrics(tmp_path: Path, prometheus_factory: Any) -> None:
    shapes = {"model.embed_tokens.weight": (256, 64), "model.layers.0.mlp.down_proj.weight": (64, 128),
              "model.norm.weight": (64,)}
    bucket, url = tmp_path / "bucket", f"file://{tmp_path / 'bucket'}"
    bucket.mkdir()
    committed: list[Manifest] = []
    sync_metrics = metrics.SyncMetrics(bucket_url=url, format_version=1)
    server = MetricsServer(sync_metrics, port=0, addr="127.0.0.1")
    ranks = [Follower(rank, url, shapes) for rank in (0, 1)]
    coordinator = Coordinator(ranks, sync_metrics, Follower(0, url, shapes),
                              Follower(0, url, shapes))
    target = f"127.0.0.1:{server.port}"
    prom = prometheus_factory(scrape_config([target]))
    coordinator.start()
    try:
        publisher = DeltaPublisher(url, anchor_every=8, on_commit=committed.append)
        final: dict[str, torch.Tensor] = {}
        for step, weights in enumerate(trainer_steps(shapes)):
            if step == 10:  # the rank sees step 10 with a corrupt data file, then it is repaired
                publisher.flush()
                coordinator.running.clear()
                publisher.publish(step, weights)
                publisher.flush()
                path, original = corrupt_next_step(bucket, step)
                coordinator.running.set()
                wait(lambda: all(r.last_error for r in [*ranks, coordinator.drafter]),
                     what="the corrupt step to fail")
                code, line = cli_status(f"http://{target}")
                assert code == 3 and "error=IntegrityError@rank0" in line, line
                prom.wait_for("max(deltasync_failing)", lambda v: v == 1)  # scraped while failing
                assert prom.value("max(deltasync_steps_behind)") == 1
                path.write_bytes(original)
            else:
                publisher.publish(step, weights)
            final = {n: w.to(torch.bfloat16) for n, w in weights.items()}
            time.sleep(0.3)
        publisher.close()
        wait(lambda: all(r.applied and r.applied.step == STEPS - 1 for r in ranks), what="catch-up")
        time.sleep(3)  # a few scrapes of the synced state
        assert coordinator.error is None, coordinator.error
        for r in ranks:  # the followers really track the trainer
            for name, w in final.items():
                assert torch.equal(r.weights[name].view(w.shape), w), name

        check_fleet_queries(prom, committed, ranks, coordinator.drafter)
        check_dashboard_and_rules(prom)
        code, line = cli_status(f"http://{target}")
        assert code == 0, line
        assert f"applied={STEPS - 1} newest={STEPS - 1} behind=0" in line and "error=-" in line
        assert http_get(f"http://{target}/synced")[0] == 200
    finally:
        coordinator.stopped.set()
        coordinator.join(timeout=10)
        server.close()


def check_fleet_queries(prom: Any, committed: list[Manifest], ranks: list[Follower],
                        drafter: Follower) -> None:
    prom.wait_for("max(deltasync_steps_behind)", lambda v: v == 0)
    assert prom.value("min(deltasync_applied_step)") == STEPS - 1
    assert prom.value("max_over_time(max(deltasync_steps_behind)[5m:1s])") >= 1
    assert prom.value(
        "max(deltasync_newest_publish_timestamp_seconds - deltasync_applied_publish_timestamp_seconds)"
    ) == 0
    for kind in ("anchor", "delta"):
        published = sum(m.totals.bytes for m in committed if m.kind == kind)
        assert published > 0
        for r in ranks:
            got = prom.value(f'deltasync_downloaded_bytes_total{{kind="{kind}", '
                             f'model="policy", rank="{r.rank}"}}')
            assert got == published, (kind, r.rank, got, published)
        got = prom.value(f'deltasync_downloaded_bytes_total{{kind="{kind}", model="drafter"}}')
        assert got == published, (kind, "drafter", got, published)
    changed = sum(sum(t.changed for t in m.tensors) for m in committed if m.kind == "delta")
    assert prom.value('sum(deltasync_applied_steps_total{kind="delta", model="policy"})') == 2 * (STEPS - 2)
    assert prom.value('deltasync_applied_step{model="drafter", rank="0"}') == STEPS - 1
    assert prom.value("min(deltasync_changed_elements_total)") >= changed > 0
    failures = prom.value('sum(deltasync_failures_total{model="policy", stage="verify", '
                          'reason="IntegrityError"})')
    assert failures == sum(n for r in ranks for s, _, n in r.stats.snapshot().failures) >= 2
    failures = prom.value('sum(deltasync_failures_total{model="drafter", reason="IntegrityError"})')
    assert failures == sum(n for _, _, n in drafter.stats.snapshot().failures) >= 1
    assert prom.value("max(deltasync_failing)") == 0
    assert prom.value("deltasync_switches_total") == STEPS
    assert prom.value("sum(deltasync_pause_duration_seconds_count)") == STEPS


def check_dashboard_and_rules(prom: Any) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [instantiate(t["expr"]) for p in dash["panels"] for t in p["targets"]]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            exprs.append(alert_lhs(rule["expr"]) if "alert" in rule else rule["expr"])
    # recording rules evaluate every second; let them produce a sample first
    prom.wait_for("count(instance:deltasync_steps_behind:max)", lambda v: v == 1)
    empty = []
    for expr in exprs:
        answer = prom.query(expr)
        assert answer["status"] == "success", (expr, answer)
        # vLLM's own series (speculative acceptance) come from vLLM's /metrics, not scraped here;
        # their names are checked against a real engine (tests/engine/test_drafter.py)
        if not answer["data"]["result"] and "vllm:" not in expr:
            empty.append(expr)
    assert not empty, f"queries that returned no data: {empty}"
    answer = json.loads(http_get(f"{prom.url}/api/v1/rules")[1])
    health = {r["name"]: (r["health"], r.get("lastError", ""))
              for g in answer["data"]["groups"] for r in g["rules"]}
    assert len(health) == sum(len(g["rules"]) for g in rules["groups"])
    assert all(h == ("ok", "") for h in health.values()), health
    firing = json.loads(http_get(f"{prom.url}/api/v1/alerts")[1])["data"]["alerts"]
    assert firing == [], firing
