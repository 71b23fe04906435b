"""``vllm-deltasync status`` against real metrics servers on loopback."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.monitoring import rank_status
from tests.helpers.net import free_port
from vllm_deltasync import cli
from vllm_deltasync.cli.status import metrics_url
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.server import metrics
from vllm_deltasync.server.endpoint import MetricsServer


@pytest.fixture
def replica() -> Iterator[tuple[metrics.SyncMetrics, str]]:
    m = metrics.SyncMetrics(bucket_url="file:///b", format_version=1)
    server = MetricsServer(m, port=0, addr="127.0.0.1")
    yield m, f"127.0.0.1:{server.port}"
    server.close()


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["status", *argv])
    return code, out.getvalue()


def rank(r: int, applied: int | None, newest: int, error: str | None = None,
         **extra: Any) -> Any:
    return rank_status(r, applied_step=applied, newest_step=newest, last_error=error,
                       applied_published_at=100.0 + (applied or 0),
                       newest_published_at=100.0 + newest, **extra)


def test_one_line_per_replica_worst_rank_shown(
        replica: tuple[metrics.SyncMetrics, str]) -> None:
    m, address = replica
    m.update([rank(0, 9, 9), rank(1, 7, 9)])
    code, out = run(address, f"http://{address}/metrics")
    lines = out.splitlines()
    assert len(lines) == 2 and code == 0
    assert lines[0] == (f"http://{address}/metrics  applied=7 newest=9 behind=2 lag=2.0s "
                        "ranks=2 error=-")
    assert run(address, "--max-steps-behind", "1")[0] == 3


def test_failing_rank_and_json(replica: tuple[metrics.SyncMetrics, str]) -> None:
    m, address = replica
    m.update([rank(0, 3, 4), rank(1, 3, 4, "IntegrityError: step 4: data file is corrupt")])
    code, out = run(address)
    assert code == 3 and out.rstrip().endswith("error=IntegrityError@rank1")
    code, out = run(address, "--json")
    [row] = json.loads(out)
    assert row["drafter"] is None  # no drafter series: nothing said of one
    assert row["applied_step"] == 3 and row["steps_behind"] == 1 and row["ranks"] == 2
    assert row["error"] == "IntegrityError@rank1" and row["unreachable"] is None


def test_a_lost_branch_is_shown_and_unhealthy(replica: tuple[metrics.SyncMetrics, str]) -> None:
    m, address = replica
    lost = rank(1, 3, 3, branch_lost="branch changed: step 3 was rewritten in the bucket")
    m.update([rank(0, 3, 3), lost])
    code, out = run(address)
    assert code == 3 and out.rstrip().endswith("error=- branch=lost@rank1")
    m.update([rank(0, 3, 3), rank(1, 3, 3)])
    code, out = run(address)
    assert code == 0 and "branch=" not in out


def test_the_drafter_is_shown_and_never_unhealthy(
        replica: tuple[metrics.SyncMetrics, str]) -> None:
    m, address = replica
    m.update([rank(0, 5, 5, drafter=rank(0, 4, 5)),
              rank(1, 5, 5, drafter=rank(1, 3, 5, "IntegrityError: step 5: data file is corrupt"))])
    code, out = run(address)
    assert code == 0, out  # the policy is current; a broken draft changes speed, not tokens
    assert out.rstrip().endswith(
        "applied=5 newest=5 behind=0 lag=0.0s ranks=2 error=- "
        "drafter=applied:3,behind:2,error:IntegrityError@rank1"), out
    assert run(address, "--max-steps-behind", "0")[0] == 0  # the policy's lag only
    [row] = json.loads(run(address, "--json")[1])
    assert row["drafter"] == "applied:3,behind:2,error:IntegrityError@rank1"


def test_unreachable_and_foreign_endpoints(replica: tuple[metrics.SyncMetrics, str]) -> None:
    _, address = replica  # nothing gathered yet: no per-rank series
    dead = f"127.0.0.1:{free_port()}"
    code, out = run(address, dead)
    first, second = out.splitlines()
    assert code == 1
    assert first.endswith("unreachable: no deltasync metrics at this URL")
    assert second.startswith(f"http://{dead}/metrics  unreachable:")


def test_url_forms() -> None:
    assert metrics_url("host:9464") == "http://host:9464/metrics"
    assert metrics_url("https://h/custom/path") == "https://h/custom/path"
    with pytest.raises(ConfigError, match="not an http"):
        metrics_url("s3://bucket/x")


def test_lora_adapters_are_shown_by_name(replica: tuple[metrics.SyncMetrics, str]) -> None:
    """Each followed LoRA adapter's series (``model=<name>``) is shown like the drafter's, and a
    refused one never makes the replica unhealthy; ``/synced?model=<name>`` says 503 for it."""
    import dataclasses

    from vllm_deltasync.server.messages import TargetStatus

    m, address = replica
    statuses = []
    for r in (0, 1):
        status = rank(r, 5, 5)
        targets = dict(status.targets)
        targets["math"] = TargetStatus(rank=r, model="math", applied_step=7, newest_step=7)
        targets["code"] = TargetStatus(rank=r, model="code", refused="adapter 'code': rank 16 "
                                       "exceeds this server's --max-lora-rank 8")
        statuses.append(dataclasses.replace(status, targets=targets))
    m.update(statuses)
    code, out = run(address)
    assert code == 0, out
    assert "math=applied:7,behind:0,error:-" in out and "code=applied:-" in out, out
    [row] = json.loads(run(address, "--json")[1])
    assert row["math"] == "applied:7,behind:0,error:-" and row["drafter"] is None
    ok, body = m.synced_target("code") or (None, None)
    assert ok is False and "rank 16" in body["ranks"][0]["refused"]
    ok, body = m.synced_target("math") or (None, None)
    assert ok is True and body["model"] == "math"
    assert [r["applied_step"] for r in body["ranks"]] == [7, 7]
    assert m.synced_target("nosuch") is None
