"""SyncConfig from --additional-config and VLLM_DELTASYNC_* (no vLLM needed)."""

from __future__ import annotations

import pytest

from vllm_deltasync._urls import redact_url
from vllm_deltasync.config import SyncConfig, is_configured
from vllm_deltasync.errors import ConfigError


def test_env_overrides_additional_config_and_types_are_coerced() -> None:
    cfg = SyncConfig.from_sources(
        {"deltasync": {"url": "file:///a", "poll_interval_s": 5, "in_flight": "drain"}},
        {"VLLM_DELTASYNC_POLL_INTERVAL_S": "0.5", "VLLM_DELTASYNC_RESET_PREFIX_CACHE": "off",
         "VLLM_DELTASYNC_LOADED_STEP": "7", "PATH": "/bin"},
    )
    assert cfg.poll_interval_s == 0.5 and cfg.in_flight == "drain"
    assert cfg.reset_prefix_cache is False and cfg.loaded_step == 7


def test_additional_config_as_a_json_string_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="is a string .*give the object itself"):
        SyncConfig.from_sources({"deltasync": '{"url": "memory://x", "max_chain": 3}'}, {})


@pytest.mark.parametrize(
    ("additional", "environ", "needle"),
    [
        ({}, {}, "VLLM_DELTASYNC_URL"),
        ({"deltasync": {"url": "file:///a", "poll_intervall_s": 1}}, {}, "poll_intervall_s"),
        ({}, {"VLLM_DELTASYNC_URL": "file:///a", "VLLM_DELTASYNC_POLL": "1"}, "VLLM_DELTASYNC_POLL"),
        ({}, {"VLLM_DELTASYNC_URL": "file:///a", "VLLM_DELTASYNC_POLL_INTERVAL_S": "0"}, "POLL_INTERVAL_S"),
        ({}, {"VLLM_DELTASYNC_URL": "file:///a", "VLLM_DELTASYNC_ON_START": "later"}, "ON_START"),
        ({}, {"VLLM_DELTASYNC_URL": "file:///a", "VLLM_DELTASYNC_MAX_CHAIN": "many"}, "MAX_CHAIN"),
        ({}, {"VLLM_DELTASYNC_URL": "file:///a", "VLLM_DELTASYNC_RESET_PREFIX_CACHE": "maybe"},
         "RESET_PREFIX_CACHE"),
        ({}, {"VLLM_DELTASYNC_URL": "not a url"}, "not a URL"),
        ({}, {"VLLM_DELTASYNC_URL": "file:///a", "VLLM_DELTASYNC_METRICS_PORT": "70000"}, "METRICS_PORT"),
        ({}, {"VLLM_DELTASYNC_URL": "file:///a", "VLLM_DELTASYNC_STAGING_CPUS": "cores 2-3"},
         "STAGING_CPUS"),
    ],
)
def test_bad_input_is_a_config_error_naming_the_option(additional, environ, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        SyncConfig.from_sources(additional, environ)


def test_credentials_are_refused_unshown_and_redact_url_keeps_clean_urls() -> None:
    with pytest.raises(ConfigError) as err:
        SyncConfig(url="s3://AKIAKEY:s3cr3t@host:9000/bucket/prefix?token=abc")
    assert "s3cr3t" not in str(err.value) and "AKIAKEY" not in str(err.value)
    assert redact_url("s3://AKIAKEY:s3cr3t@host:9000/bucket/prefix?token=abc") == (
        "s3://host:9000/bucket/prefix")
    assert redact_url("hf://buckets/ns/name") == "hf://buckets/ns/name"


def test_is_configured() -> None:
    assert is_configured({"deltasync": {"url": "file:///a"}}, {})
    assert is_configured(None, {"VLLM_DELTASYNC_URL": "file:///a"})
    assert not is_configured({}, {"VLLM_DELTASYNC_URL": ""})


def test_store_options_reach_the_backend_and_never_show() -> None:
    cfg = SyncConfig.from_sources(
        {"deltasync": {"url": "s3://b/p", "store_options": {"aws_secret_access_key": "s3cr3t"}}},
        {"VLLM_DELTASYNC_STORE_OPTIONS": '{"addressing_style": "path", "region_name": "us-east-1"}'},
    )
    assert cfg.store_options == {"addressing_style": "path", "region_name": "us-east-1"}
    assert "path" not in repr(cfg) and "s3cr3t" not in repr(cfg)
    with pytest.raises(ConfigError) as info:
        SyncConfig.from_sources({}, {"VLLM_DELTASYNC_URL": "s3://b", "VLLM_DELTASYNC_STORE_OPTIONS": '{"k": s3cr3t'})
    assert "VLLM_DELTASYNC_STORE_OPTIONS" in str(info.value) and "s3cr3t" not in str(info.value)
    with pytest.raises(ConfigError, match="JSON object"):
        SyncConfig.from_sources({}, {"VLLM_DELTASYNC_URL": "s3://b", "VLLM_DELTASYNC_STORE_OPTIONS": "[1]"})


def test_utility_calls_that_may_write_weights_tick_the_coordinator() -> None:
    """After these client utility calls the engine core ticks before the next batch (a reload
    behind our back is noticed before any request is served under the old step label)."""
    from vllm_deltasync.server.vllm.engine import may_write_weights as _may_write_weights

    def call(method: str, *args: object) -> tuple[int, int, str, tuple[object, ...]]:
        return (0, 1, method, args)

    assert _may_write_weights(call("collective_rpc", "reload_weights", None, (), {}))
    assert _may_write_weights(call("collective_rpc", "my_update", None, (), {}))
    assert _may_write_weights(call("collective_rpc", b"<pickled function>", None, (), {}))
    assert _may_write_weights(call("update_weight_version", "7"))
    assert not _may_write_weights(call("collective_rpc", "deltasync_status", None, (), {}))
    assert not _may_write_weights(call("get_weight_version"))
    assert not _may_write_weights(call("deltasync_engine_status"))
    assert not _may_write_weights(call("is_sleeping"))
    assert not _may_write_weights("not a utility request")
