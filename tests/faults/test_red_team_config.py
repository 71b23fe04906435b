"""Red team round 3 (issue 36), configuration and URL rows: one test per row, named after it,
and one test that drives every entry point with every URL spelling of a credential.

* S2/S3: a credential with ``/`` in it (``s3://KEY:sec/ret@b/p``: RFC 3986 ends the authority
  at the ``/``) was not seen as one and was printed, or looked up as a host;
* S5/S6: ``nan`` (and ``1e-300``) intervals and waits were accepted and hung the engine;
* S7: ``none`` for an integer option raised TypeError (a dead worker) instead of ConfigError;
* S9: a cpu list was expanded without bound (``0-99999999``: 11.8 GB);
* S12: a mixed-case variable was neither used nor refused;
* A4: ``additional_config.deltasync`` as a string or a list; ``5_0`` and non-ASCII digits.

The engine half of S5 and S7 (a real server refuses visibly and answers a completion) is in
tests/engine/test_bad_config.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.faults import LookupLog, cli, one_line_error
from vllm_deltasync import DeltaPublisher
from vllm_deltasync._urls import redact_text, redact_url
from vllm_deltasync.config import SyncConfig, is_configured
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.stores import open_store

URL = {"VLLM_DELTASYNC_URL": "file:///data/bucket"}

# Secrets planted in every spelling; each piece must appear nowhere. The halves of a secret
# with '/' in it are checked one by one (a leak shows one of them: the part before the '/').
KEY = "AKIAREDTEAMKEY36"
HALF1, HALF2 = "RedTeamSec36a", "RedTeamSec36b"
SLASHED = f"{HALF1}/{HALF2}"  # a base64 AWS secret key may hold '/'
TOKEN1, TOKEN2 = "hf_redteam36x", "redteam36y"
PIECES = (KEY, HALF1, HALF2, TOKEN1, TOKEN2)

CREDENTIAL_URLS = {
    "s3-slash": f"s3://{KEY}:{SLASHED}@bucket/prefix",
    "s3-plain": f"s3://{KEY}:{HALF1}@bucket/prefix",
    "hf-slash": f"hf://user:{TOKEN1}/{TOKEN2}@buckets/ns/name",
    "hf-plain": f"hf://user:{TOKEN1}@buckets/ns/name",
    "file-slash": f"file://user:{HALF1}/{HALF2}@/path/bucket",
    "s3-one-slash": f"s3:/{KEY}:{HALF1}@b/p",
    "s3-no-slashes": f"s3:{KEY}:{HALF1}@b/p",
    "s3-empty-authority": f"s3:///{KEY}:{SLASHED}@b/p",
    "http-slash": f"http://user:{HALF1}/{HALF2}@rt36-metrics.invalid:9/metrics",
    "http-port-like": f"http://user:1234/{HALF1}@rt36-metrics.invalid:9/metrics",
    "s3-query": f"s3://bucket/p?X-Amz-Security-Token={TOKEN1}",
}


def assert_clean(*texts: Any) -> None:
    for text in texts:
        shown = text if isinstance(text, str) else json.dumps(text, default=str)
        for piece in PIECES:
            assert piece not in shown, f"{piece!r} leaked in: {shown[:400]}"


def _refused(call: Any) -> str:
    with pytest.raises(ConfigError) as err:
        call()
    assert len(str(err.value).splitlines()) == 1
    return str(err.value)


# -- S2 / S3: credentials in any spelling ------------------------------------------------------


def test_S2_secret_with_a_slash_is_refused_unshown(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    url = CREDENTIAL_URLS["s3-slash"]
    monkeypatch.chdir(tmp_path)
    lookups = LookupLog(monkeypatch)
    messages = [
        _refused(lambda: open_store(url)),
        _refused(lambda: SyncConfig(url=url)),
        _refused(lambda: SyncConfig.from_sources({}, {"VLLM_DELTASYNC_URL": url})),
        _refused(lambda: SyncConfig(url="file:///b", drafter_url=url)),
        _refused(lambda: open_store(CREDENTIAL_URLS["hf-slash"])),
        _refused(lambda: open_store(CREDENTIAL_URLS["file-slash"])),  # not a relative path
    ]
    assert all("may carry a credential" in m and "never in the URL" in m for m in messages)
    assert_clean(messages, redact_url(url), redact_text(f"bucket {url} failed"))
    assert redact_url(url) == "s3://bucket/prefix"
    assert list(tmp_path.iterdir()) == [] and lookups.hosts == []


def test_S2_status_never_looks_up_a_credential_position(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    lookups = LookupLog(monkeypatch)
    for case in ("s3-one-slash", "s3-no-slashes"):  # looked up 's3', or 'b', before
        rc, out, err = cli(capsys, "status", CREDENTIAL_URLS[case])
        one_line_error(rc, err)
        assert "may carry a credential" in err and not out
        assert_clean(out, err)
    assert lookups.hosts == []


def test_S2_store_endpoints_with_userinfo_are_refused_unshown(
        all_logs: pytest.LogCaptureFixture) -> None:
    endpoint = f"http://{KEY}:{SLASHED}@127.0.0.1:9"
    messages = [_refused(lambda: open_store("s3://bucket/p", endpoint_url=endpoint)),
                _refused(lambda: open_store("hf://buckets/ns/name", endpoint=endpoint,
                                            environ={})),
                _refused(lambda: open_store("hf://buckets/ns/name",
                                            environ={"HF_ENDPOINT": endpoint}))]
    assert all("endpoint" in m.lower() for m in messages)
    assert_clean(messages, all_logs.text)


def test_S3_status_password_with_a_slash_is_refused_before_any_lookup(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    lookups = LookupLog(monkeypatch)
    for case in ("http-slash", "http-port-like"):  # printed, or looked up 'user', before
        rc, out, err = cli(capsys, "status", CREDENTIAL_URLS[case])
        one_line_error(rc, err)
        assert_clean(out, err)
    assert lookups.hosts == []


# -- S5, S6, S7, S9, S12, A4: one validator -----------------------------------------------------


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "1e-300", "0", "-1", "1e400"])
def test_S5_poll_interval_nan(raw: str) -> None:
    message = _refused(lambda: SyncConfig.from_sources({}, {**URL, "VLLM_DELTASYNC_POLL_INTERVAL_S": raw}))
    assert "VLLM_DELTASYNC_POLL_INTERVAL_S" in message and "0.01 to 3600" in message
    section = {"url": "file:///b", "poll_interval_s": json.loads("NaN")}  # JSON takes NaN
    assert "poll_interval_s" in _refused(lambda: SyncConfig.from_sources({"deltasync": section}, {}))
    assert "poll_interval_s" in _refused(lambda: SyncConfig(url="file:///b", poll_interval_s=math.nan))


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "0", "1e99"])
def test_S6_update_wait_nan(raw: str) -> None:
    message = _refused(lambda: SyncConfig.from_sources({}, {**URL, "VLLM_DELTASYNC_UPDATE_WAIT_S": raw}))
    assert "VLLM_DELTASYNC_UPDATE_WAIT_S" in message and "86400" in message
    for name in ("max_drain_wait_s", "min_version_wait_s", "fetch_jitter_s"):
        assert name in _refused(lambda n=name: SyncConfig(url="file:///b", **{n: math.inf}))


@pytest.mark.parametrize("var", ["MAX_CHAIN", "METRICS_PORT", "DOWNLOAD_CONCURRENCY",
                                 "MAX_STAGED_BYTES", "DEBUG_RING_SIZE"])
def test_S7_integer_option_none_is_a_config_error(var: str) -> None:
    message = _refused(lambda: SyncConfig.from_sources({}, {**URL, f"VLLM_DELTASYNC_{var}": "none"}))
    assert f"VLLM_DELTASYNC_{var}" in message and "use an integer from" in message


HOSTILE: tuple[Any, ...] = (
    None, "none", "", " ", "nan", "inf", "1e-300", "-1", "5_0", "\u0663", "0x10", "true",
    True, 1.5, -1, 10**30, math.nan, math.inf, [], {}, ["x"], {"a": 1}, "[", "{}", "0-99999999",
    "s3://K:S/x@b/p",
)


@pytest.mark.parametrize("name", sorted(f.name for f in dataclasses.fields(SyncConfig)))
def test_S7_every_option_fails_only_with_config_error(name: str) -> None:
    """Whatever a source gives for any option: a value, or a ConfigError naming the option;
    never TypeError, AttributeError, ValueError (a dead worker, a hung engine)."""
    from vllm_deltasync.config import env_names

    var = env_names()[name]
    for raw in HOSTILE:
        sources: list[tuple[dict[str, Any], dict[str, str]]] = [
            ({"deltasync": {"url": "file:///b", name: raw}}, {})]
        if isinstance(raw, str):
            sources.append(({}, {**URL, var: raw}))
        for additional, environ in sources:
            try:
                cfg = SyncConfig.from_sources(additional, environ)
            except ConfigError as exc:
                assert name in str(exc) or var in str(exc) or "URL" in str(exc), str(exc)
                continue
            value = getattr(cfg, name)  # accepted: of the field's kind, finite
            assert not (isinstance(value, float) and not math.isfinite(value))


def test_S9_staging_cpus_bounded() -> None:
    tracemalloc.start()
    try:
        for raw in ("0-99999999", "8192", "0-8192", ",".join(["0-8191"] * 2000)):
            message = _refused(lambda r=raw: SyncConfig.from_sources({}, {**URL, "VLLM_DELTASYNC_STAGING_CPUS": r}))
            assert "VLLM_DELTASYNC_STAGING_CPUS" in message
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # was 11.8 GB for the first one
    ok = SyncConfig.from_sources({}, {**URL, "VLLM_DELTASYNC_STAGING_CPUS": "0-8191"})
    assert ok.staging_cpus == "0-8191"


@pytest.mark.parametrize("var", ["VLLM_DELTASYNC_Poll_Interval_S", "vllm_deltasync_url",
                                 "VLLM_DELTASYNC_POLL_INTERVAL_s", "VLLM_DELTASYNC_MIRROR_URLS"])
def test_S12_mixed_case_variable_is_refused(var: str) -> None:
    message = _refused(lambda: SyncConfig.from_sources({}, {**URL, var: "1"}))
    assert var in message and "did you mean VLLM_DELTASYNC_" in message


def test_A4_additional_config_string_list_and_loose_integers() -> None:
    as_string = {"deltasync": json.dumps({"url": "file:///b"})}
    assert "give the object itself" in _refused(lambda: SyncConfig.from_sources(as_string, {}))
    assert "is a list" in _refused(lambda: SyncConfig.from_sources({"deltasync": ["x"]}, {}))
    assert "not a JSON object" in _refused(lambda: SyncConfig.from_sources(["x"], {}))  # type: ignore[arg-type]
    assert is_configured(as_string, {}) and is_configured({"deltasync": ["x"]}, {})
    for raw in ("5_0", "\u0665\u0660", "\uff15", " 5 0", "+-5"):
        message = _refused(lambda r=raw: SyncConfig.from_sources({}, {**URL, "VLLM_DELTASYNC_MAX_CHAIN": r}))
        assert "ASCII digits" in message
    assert SyncConfig.from_sources({}, {**URL, "VLLM_DELTASYNC_MAX_CHAIN": " 50 "}).max_chain == 50


def test_new_fields_parse_validate_and_default() -> None:
    from vllm_deltasync.config import rule_of
    from vllm_deltasync.server.worker.bucket import fetch_jitter_s

    cfg = SyncConfig(url="file:///b")
    assert cfg.mirror_urls == () and cfg.fetch_jitter_s is None and cfg.lora_urls == {}
    assert cfg.lora_versions_kept == 2
    assert fetch_jitter_s(cfg, "file") == 0.0 and fetch_jitter_s(cfg, "hf") == 2.0
    assert fetch_jitter_s(dataclasses.replace(cfg, poll_interval_s=30.0), "s3") == 5.0
    env = {**URL, "VLLM_DELTASYNC_MIRRORS": "https://a.example/b,http://[::1]:8080/b",
           "VLLM_DELTASYNC_IN_FLIGHT": "keep_kv", "VLLM_DELTASYNC_FETCH_JITTER_S": "0",
           "VLLM_DELTASYNC_LORA_URLS": '{"math-v1.2": "file:///a/math"}'}
    cfg = SyncConfig.from_sources({}, env)
    assert cfg.mirror_urls == ("https://a.example/b", "http://[::1]:8080/b")
    assert cfg.in_flight == "keep_kv" and fetch_jitter_s(cfg, "hf") == 0.0
    assert cfg.lora_urls == {"math-v1.2": "file:///a/math"}
    bad_mirrors = ["s3://b/p", "https://a/b?t=1", "https://a:99999/b", "https://a/b,https://a/b",
                   "https://", ",".join(f"https://m{i}" for i in range(17)), "https://a,"]
    for raw in bad_mirrors:
        assert "VLLM_DELTASYNC_MIRRORS" in _refused(
            lambda r=raw: SyncConfig.from_sources({}, {**URL, "VLLM_DELTASYNC_MIRRORS": r}))
    for raw in ('{"a@b": "file:///x"}', '{"a/b": "file:///x"}', '{"": "file:///x"}',
                '{"a": "relative"}', '{"a": 3}', '["file:///x"]'):
        assert "VLLM_DELTASYNC_LORA_URLS" in _refused(
            lambda r=raw: SyncConfig.from_sources({}, {**URL, "VLLM_DELTASYNC_LORA_URLS": r}))
    assert "LORA_VERSIONS_KEPT" in _refused(
        lambda: SyncConfig.from_sources({}, {**URL, "VLLM_DELTASYNC_LORA_VERSIONS_KEPT": "0"}))
    assert "IN_FLIGHT" in _refused(
        lambda: SyncConfig.from_sources({}, {**URL, "VLLM_DELTASYNC_IN_FLIGHT": "KEEP_KV"}))
    for f in dataclasses.fields(SyncConfig):  # every field states its range or its values
        assert rule_of(f).expects()


# -- every entry point, every spelling ----------------------------------------------------------


def test_no_secret_reaches_any_entry_point_and_nothing_is_looked_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        all_logs: pytest.LogCaptureFixture) -> None:
    """Every URL form of :data:`CREDENTIAL_URLS` through config (constructor, sources, each URL
    option), open_store, the publisher, each CLI verb and the redaction of text: refused or
    redacted, no secret piece in any message, output or log line (DEBUG included), no host
    name looked up (every one is refused before a connection), nothing created locally."""
    src = tmp_path / "src"  # an existing source, so that import-trl reaches its destination
    src.mkdir()
    monkeypatch.chdir(tmp_path)
    lookups = LookupLog(monkeypatch)
    shown: list[str] = []
    for url in CREDENTIAL_URLS.values():
        shown += [redact_url(url), redact_text(f"GET {url} failed; retry ({url})."),
                  _refused(lambda u=url: SyncConfig.from_sources({}, {"VLLM_DELTASYNC_URL": u})),
                  _refused(lambda u=url: SyncConfig.from_sources(
                      {"deltasync": {"url": "file:///b", "lora_urls": {"a": u}}}, {})),
                  _refused(lambda u=url: SyncConfig.from_sources(
                      {}, {**URL, "VLLM_DELTASYNC_MIRRORS": u}))]
        if not url.startswith("http"):
            shown += [_refused(lambda u=url: open_store(u)),
                      _refused(lambda u=url: DeltaPublisher(u)),
                      _refused(lambda u=url: SyncConfig(url=u))]
        for argv in (("inspect", url), ("verify", url), ("status", url),
                     ("materialize", url, "--out", str(tmp_path / "out")),
                     ("import-trl", url, f"file://{tmp_path}/dst"),
                     ("import-trl", str(src), url)):
            rc, out, err = cli(capsys, *argv)
            assert rc != 0, argv
            shown += [out, err]
    assert_clean(shown, all_logs.text)
    assert lookups.hosts == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
