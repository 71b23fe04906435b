"""PROMETHEUS_MULTIPROC_DIR: values set in the engine-core process reach another process's
MultiProcessCollector (what vLLM's API server serves on its /metrics in that mode)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.monitoring import parse_exposition

ENGINE_CORE = """
from vllm_deltasync.server import metrics
from vllm_deltasync.server.messages import RankStatus, TargetStatus
m = metrics.SyncMetrics(bucket_url="file:///bucket", format_version=1)
stats = metrics.WorkerStats()
stats.add_download("delta", 1234, 0.5)

def rank(r, applied):
    return RankStatus({"policy": TargetStatus(rank=r, model="policy", applied_step=applied,
                                              newest_step=7, counters=stats.snapshot())},
                      "policy")

m.update([rank(0, 5), rank(1, 6)])
m.update([rank(0, 7), rank(1, 7)])
m.observe_switch(7, 0.01)
"""

API_SERVER = """
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
registry = CollectorRegistry()
MultiProcessCollector(registry)
print(generate_latest(registry).decode())
"""


def run(code: str, mpdir: Path) -> str:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mpdir)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    return result.stdout


def test_values_reach_the_api_server_process(tmp_path: Path) -> None:
    run(ENGINE_CORE, tmp_path)
    values = parse_exposition(run(API_SERVER, tmp_path))
    # gauges: the most recent value, no pid label
    assert values[("deltasync_applied_step", (("model", "policy"), ("rank", "0")))] == 7
    assert values[("deltasync_steps_behind", (("model", "policy"), ("rank", "1")))] == 0
    assert values[("deltasync_bucket_info", (("format_version", "1"), ("url", "file:///bucket")))] == 1
    # counters and histograms: summed over processes, counted once per increment
    key = ("deltasync_downloaded_bytes_total", (("kind", "delta"), ("model", "policy"), ("rank", "0")))
    assert values[key] == 1234
    assert values[("deltasync_switches_total", ())] == 1
    assert values[("deltasync_pause_duration_seconds_count", ())] == 1
    assert not any("pid" in dict(labels) for _, labels in values)
