"""Fault matrix, secrets (item 2): credentials pasted into a bucket URL are refused in one line
that names where credentials belong; query strings and userinfo are redacted wherever a URL is
printed; planted secrets appear in no exception, log line, status, metric or CLI output.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from tests.helpers.faults import PLANTED, Hostile, assert_no_secret, cli, one_line_error
from vllm_deltasync import DeltaPublisher
from vllm_deltasync._urls import redact_text, redact_url
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import ConfigError, DeltaSyncError
from vllm_deltasync.server.worker.poller import Poller
from vllm_deltasync.stores import open_store
from vllm_deltasync.stores.hf import HfStore

KEY, SECRET, SESSION, TOKEN = PLANTED

URLS_WITH_CREDENTIALS = {
    "s3-userinfo": f"s3://{KEY}:{SECRET}@bucket/p?X-Amz-Security-Token={SESSION}",
    "s3-query": f"s3://bucket/p?X-Amz-Security-Token={SESSION}",
    "hf-userinfo": f"hf://user:{TOKEN}@buckets/ns/name/p",
    "file-query": f"file:///tmp/b?token={TOKEN}",
}


@pytest.mark.parametrize("case", sorted(URLS_WITH_CREDENTIALS))
def test_credentials_in_a_bucket_url_are_refused_without_echo(
        case: str, capsys: pytest.CaptureFixture[str], all_logs: pytest.LogCaptureFixture) -> None:
    url = URLS_WITH_CREDENTIALS[case]
    with pytest.raises(ConfigError) as err:
        open_store(url)
    msg = str(err.value)
    assert "environment" in msg and "store_options" in msg
    assert len(msg.splitlines()) == 1
    with pytest.raises(ConfigError) as pub_err:
        DeltaPublisher(url)
    with pytest.raises(ConfigError) as poll_err:  # what a server rank does at start
        Poller(SyncConfig(url=url), lambda m, p: (p, 1))
    rc, out, cli_err = cli(capsys, "inspect", url)
    one_line_error(rc, cli_err)
    rc2, out2, err2 = cli(capsys, "verify", url)
    one_line_error(rc2, err2)
    assert_no_secret(msg, str(pub_err.value), str(poll_err.value),
                     out, cli_err, out2, err2, all_logs.text)


def test_redaction_of_urls_inside_any_text() -> None:
    text = (f"GET https://cdn.example/x?X-Amz-Signature={SECRET}&Expires=1 failed; "
            f"bucket s3://{KEY}:{SECRET}@b/p; retry token={TOKEN}")
    shown = redact_text(text)
    assert_no_secret(shown, redact_url(f"s3://{KEY}:{SECRET}@b/p?t={SESSION}"))
    assert "https://cdn.example/x?<redacted>" in shown and "s3://b/p" in shown


def test_hostile_server_echoing_the_token_does_not_leak_it(hostile: Hostile, run: Any,
                                                           all_logs: pytest.LogCaptureFixture) -> None:
    async def echo(request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        return web.Response(status=500, headers={
            "X-Error-Message": f"bad credentials {auth} see {hostile.url}/help?token={TOKEN}"})

    hostile.on("GET", "/api/buckets/ns/name/tree/p/manifests", echo)
    from vllm_deltasync.stores import RetryPolicy
    store = open_store("hf://buckets/ns/name/p", endpoint=hostile.url, token=TOKEN, environ={},
                       retry_policy=RetryPolicy(attempts=1))
    assert isinstance(store, HfStore)
    with pytest.raises(DeltaSyncError) as err:
        run(store.list("manifests/"))
    run(store.close())
    assert "HTTP 500" in str(err.value)
    assert_no_secret(str(err.value), repr(store), all_logs.text)


def test_status_cli_refuses_userinfo_and_redacts_query(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "status", f"http://u:{SECRET}@127.0.0.1:1/metrics?token={TOKEN}")
    assert rc == 1 and "may carry a credential" in err and not out
    rc, out, err = cli(capsys, "status", f"http://127.0.0.1:1/metrics?token={TOKEN}")
    assert rc == 1 and "unreachable" in out
    assert_no_secret(out, err)


def test_synced_and_metrics_never_show_a_url_secret() -> None:
    """/synced and the bucket label redact what reaches them, whatever a rank reported."""
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_deltasync.server import metrics
    from vllm_deltasync.server.messages import RankStatus, TargetStatus

    registry = CollectorRegistry()
    m = metrics.SyncMetrics(registry=registry, bucket_url=f"s3://{KEY}:{SECRET}@b/p?t={SESSION}")
    leaky = f"StoreError: GET https://cdn.example/x?X-Amz-Signature={SECRET} failed"
    status = TargetStatus(rank=0, model="policy", applied_step=1, newest_step=2,
                          last_error=leaky, counters=metrics.WorkerStats().snapshot())
    m.update([RankStatus({"policy": status}, "policy")], now=1.0)
    m.coordinator_state(failing=True, error=RuntimeError(f"tick: s3://{KEY}:{SECRET}@b/p"))
    _, body = m.synced()
    assert_no_secret(body, generate_latest(registry).decode())


def test_engine_core_failures_never_show_a_secret(caplog: pytest.LogCaptureFixture) -> None:
    """A tick that fails with a URL carrying credentials in its message: the coordinator's
    last_error, its status, /synced and its log line (with the traceback) are redacted."""
    from vllm_deltasync.server.engine.coordinator import Coordinator

    leak = f"https://{KEY}:{SECRET}@cdn.example/x?X-Amz-Security-Token={SESSION}&sig=1"

    class EngineCore:  # the part of vLLM's EngineCore the coordinator calls
        def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
            raise RuntimeError(f"rank 0 could not reach {leak}")

        def get_weight_version(self) -> str:
            return "3"

    coord = Coordinator(EngineCore(), SyncConfig(url="file:///tmp/b", metrics_port=0),
                        wake=lambda: None)
    coord.active = True
    with caplog.at_level("ERROR"):
        for _ in range(3):
            coord.tick()
    shown = [coord.last_error or "", str(coord.engine_status()),
             str(coord.metrics.synced()[1]), caplog.text]
    assert "cdn.example/x" in shown[0] and shown[2].count("cdn.example") == 1
    assert coord.engine_status()["failing"] and not coord.metrics.synced()[0]
    for text in shown:
        assert_no_secret(text)
