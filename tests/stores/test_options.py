"""Store options: ``S3Options`` / ``HfOptions`` and the ``store_options`` keys of ``open_store``.

Every key documented in docs/transports.md is accepted by ``open_store(url, **opts)`` and
reaches the store; unknown keys and bad values are refused with a ConfigError naming them;
credentials never show in ``repr``. Nothing here touches the network.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from vllm_deltasync.errors import ConfigError
from vllm_deltasync.stores import RetryPolicy, _retry, open_store
from vllm_deltasync.stores.hf import HfOptions, HfStore
from vllm_deltasync.stores.s3 import S3Options, S3Store

DOCS = Path(__file__).resolve().parents[2] / "docs" / "transports.md"
POLICY = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.1)

S3_KEYS: dict[str, Any] = {  # a value other than the default for every s3:// option
    "endpoint_url": "http://127.0.0.1:9000",
    "region_name": "eu-west-1",
    "addressing_style": "path",
    "aws_access_key_id": "AKIA-KEY-ID-0001",
    "aws_secret_access_key": "s3-secret-value-0001",
    "aws_session_token": "s3-session-token-0001",
    "profile": "training",
    "conditional_writes": False,
    "multipart_threshold": 32 << 20,
    "part_size": 8 << 20,
    "max_parallel_parts": 3,
    "max_pool_connections": 7,
    "stale_upload_s": 120.0,
    "min_bytes_per_s": 2048,
    "rate_window_s": 4.5,
    "max_request_s": 60.0,
    "retry_policy": POLICY,
}
HF_KEYS: dict[str, Any] = {  # the same for hf:// (runtime objects aside)
    "endpoint": "http://127.0.0.1:8080",
    "token": "hf_secret_token_0001",
    "part_size": 1 << 17,
    "max_parallel_parts": 2,
    "request_timeout_s": 5.5,
    "min_bytes_per_s": 1024,
    "rate_window_s": 2.5,
    "max_request_s": 30.0,
    "max_redirects": 3,
    "allow_redirects_to": ("private",),
    "retry_policy": POLICY,
}
HF_RUNTIME = ("session", "uploader", "environ")
SECRETS = ("AKIA-KEY-ID-0001", "s3-secret-value-0001", "s3-session-token-0001", "hf_secret_token_0001")


def documented_keys(section: str) -> set[str]:
    """The option names in the first column of the options table under ``## `{section}``."""
    text = DOCS.read_text()
    start = text.index(f"## `{section}")
    end = text.find("\n## ", start + 1)
    keys: set[str] = set()
    for line in text[start : end if end > 0 else None].splitlines():
        if line.startswith("| `"):
            keys.update(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return keys


def test_docs_tables_list_exactly_the_accepted_keys() -> None:
    assert documented_keys("s3://") == set(S3Options.keys()) == set(S3_KEYS)
    assert documented_keys("hf://") == set(HfOptions.keys()) | set(HF_RUNTIME)
    assert set(HfOptions.keys()) == set(HF_KEYS)


def test_every_s3_key_is_accepted_and_reaches_the_store() -> None:
    store = open_store("s3://bkt/some/prefix/", **S3_KEYS)
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix) == ("bkt", "some/prefix")
    for key, value in S3_KEYS.items():
        assert getattr(store.options, key) == value, key
    assert store.options.credentials() == {
        k: S3_KEYS[k] for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
    }
    assert (store.endpoint_url, store.region_name, store.addressing_style) == (
        "http://127.0.0.1:9000",
        "eu-west-1",
        "path",
    )
    assert (store.part_size, store.multipart_threshold, store.max_parallel_parts) == (8 << 20, 32 << 20, 3)
    assert store.retry_policy is POLICY and store.conditional_writes is False
    # the object form is the same store
    same = S3Store("bkt", "some/prefix", S3Options(**S3_KEYS))
    assert same.options == store.options and same.url == store.url


def test_every_hf_key_is_accepted_and_reaches_the_store(run: Any) -> None:
    async def uploader(items: list[tuple[str, bytes]]) -> None:
        return None

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            store = open_store(
                "hf://buckets/ns/name/pre",
                **HF_KEYS,
                session=session,
                uploader=uploader,
                environ={"HF_ENDPOINT": "http://elsewhere"},
            )
            assert isinstance(store, HfStore)
            for key, value in HF_KEYS.items():
                assert getattr(store.options, key) == value, key
            assert store._session is session and store._uploader is uploader
            assert store.endpoint == "http://127.0.0.1:8080"  # the option beats HF_ENDPOINT
            assert store._auth("http://127.0.0.1:8080/x") == {"Authorization": "Bearer hf_secret_token_0001"}
            assert store._timeout.sock_read == 5.5
            assert (store.part_size, store.max_parallel_parts, store.retry_policy) == (1 << 17, 2, POLICY)
            await store.close()
            assert not session.closed  # an injected session belongs to the caller

    run(scenario())
    env_only = open_store("hf://buckets/ns/name", environ={"HF_ENDPOINT": "http://hub.local/", "HF_TOKEN": "t"})
    assert isinstance(env_only, HfStore)
    assert env_only.endpoint == "http://hub.local" and env_only.options == HfOptions()
    same = HfStore("ns/name", "pre", HfOptions(**HF_KEYS), environ={})
    assert same.options == HfOptions(**HF_KEYS) and same.url == "hf://buckets/ns/name/pre"


def test_options_object_through_open_store_and_the_gateway() -> None:
    base = S3Options(region_name="eu-west-1", part_size=6 << 20, multipart_threshold=6 << 20)
    store = open_store("s3://bkt", options=base, region_name="us-east-2")
    assert isinstance(store, S3Store)
    assert store.options == dataclasses.replace(base, region_name="us-east-2")  # keys win
    hf = open_store("hf://buckets/ns/name", options=HfOptions(part_size=1 << 16), token=False, environ={})
    assert isinstance(hf, HfStore) and hf.options == HfOptions(part_size=1 << 16, token=False)

    gateway = S3Store.hub_gateway("ns", "bkt", "p", aws_access_key_id="k", aws_secret_access_key="s")
    assert (gateway.endpoint_url, gateway.region_name, gateway.addressing_style) == (
        "https://s3.hf.co/ns",
        "us-east-1",
        "path",
    )
    assert gateway.options.credentials() == {"aws_access_key_id": "k", "aws_secret_access_key": "s"}
    custom = S3Store.hub_gateway("ns", "bkt", options=S3Options(endpoint_url="http://gw.local/ns"))
    assert (custom.endpoint_url, custom.region_name) == ("http://gw.local/ns", "us-east-1")
    assert S3Store.hub_gateway("ns", "bkt", addressing_style=None).addressing_style is None


def test_retry_policy_from_json_config() -> None:
    """A JSON ``store_options`` (engine config) cannot carry a RetryPolicy: a mapping of its
    fields is accepted; None means the defaults."""
    store = open_store("s3://bkt", retry_policy={"attempts": 2, "max_delay_s": 1.0})
    assert isinstance(store, S3Store)
    assert store.retry_policy == RetryPolicy(attempts=2, max_delay_s=1.0)
    assert S3Options(retry_policy=None).retry_policy == RetryPolicy()  # type: ignore[arg-type]
    hf = open_store("hf://buckets/ns/name", retry_policy={"attempts": 9}, token=False, environ={})
    assert isinstance(hf, HfStore) and hf.retry_policy == RetryPolicy(attempts=9)


def test_retry_policy_import_paths() -> None:
    assert RetryPolicy is _retry.RetryPolicy
    from vllm_deltasync.stores.hf import RetryPolicy as FromHf
    from vllm_deltasync.stores.s3 import RetryPolicy as FromS3

    assert FromHf is FromS3 is RetryPolicy


@pytest.mark.parametrize(
    ("url", "key", "accepted"),
    [
        ("s3://bkt/p", "part_sise", "did you mean 'part_size'"),
        ("s3://bkt/p", "token", "aws_session_token"),
        ("hf://buckets/ns/name", "endpoint_url", "did you mean 'endpoint'"),
        ("hf://buckets/ns/name", "wibble", "uploader"),
    ],
)
def test_unknown_key_is_refused_naming_it(url: str, key: str, accepted: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(url, **{key: 1})
    message = str(info.value)
    assert repr(key) in message and "accepted:" in message and accepted in message
    assert url.split("://")[1].split("/")[0] in message  # says which store


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"part_size": 1 << 20}, "part_size"),
        ({"part_size": "16MiB"}, "part_size"),
        ({"part_size": 8 << 20, "multipart_threshold": 6 << 20}, "multipart_threshold"),
        ({"max_parallel_parts": 0}, "max_parallel_parts"),
        ({"max_pool_connections": True}, "max_pool_connections"),
        ({"addressing_style": "sideways"}, "addressing_style"),
        ({"conditional_writes": "no"}, "conditional_writes"),
        ({"endpoint_url": 9000}, "endpoint_url"),
        ({"retry_policy": {"attempts": 0}}, "retry_policy"),
        ({"retry_policy": {"tries": 3}}, "tries"),
        ({"retry_policy": "fast"}, "retry_policy"),
    ],
)
def test_bad_s3_values_name_the_option(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        open_store("s3://bkt", **options)
    with pytest.raises(ConfigError, match=f"S3Options.*{named}"):
        S3Options(**options)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"part_size": 1000}, "part_size"),
        ({"max_parallel_parts": 0}, "max_parallel_parts"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"request_timeout_s": "60"}, "request_timeout_s"),
        ({"endpoint": "huggingface.co"}, "endpoint"),
        ({"token": 12345}, "token"),
        ({"retry_policy": {"attempts": "many"}}, "retry_policy"),
    ],
)
def test_bad_hf_values_name_the_option(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named) as info:
        open_store("hf://buckets/ns/name", environ={}, **options)
    assert "12345" not in str(info.value)  # a token's value is never echoed
    with pytest.raises(ConfigError, match=f"HfOptions.*{named}"):
        HfOptions(**options)


def test_options_must_be_an_options_object() -> None:
    with pytest.raises(ConfigError, match="S3Options"):
        S3Store("bkt", "p", {"part_size": 5 << 20})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="HfOptions"):
        HfStore("ns/name", "p", {"token": False})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="S3Options"):
        open_store("s3://bkt", options=HfOptions())


def test_secrets_never_show_in_repr() -> None:
    s3 = open_store("s3://bkt/p", **S3_KEYS)
    hf = open_store("hf://buckets/ns/name", **HF_KEYS, environ={})
    assert isinstance(s3, S3Store) and isinstance(hf, HfStore)
    shown = [repr(s3), str(vars(s3)), repr(s3.options), str(s3.options)]
    shown += [repr(hf), str(vars(hf)), repr(hf.options), str(hf.options)]
    shown += [repr(S3Options(**S3_KEYS)), repr(HfOptions(**HF_KEYS))]
    for text in shown:
        for secret in SECRETS:
            assert secret not in text, (secret, text)
    assert "eu-west-1" in repr(s3.options) and "127.0.0.1:8080" in repr(hf.options)  # the rest shows
    with pytest.raises(ConfigError) as info:
        open_store("s3://bkt", aws_secret_access_key=b"s3-secret-value-0001")
    assert "s3-secret-value-0001" not in str(info.value) and "aws_secret_access_key" in str(info.value)


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        S3Options().part_size = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        HfOptions().token = "x"  # type: ignore[misc]
