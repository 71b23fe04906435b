"""Every documented public path imports, and one real call goes through each.

Documented in README.md, docs/transports.md and docs/architecture.md: the package root
(``DeltaPublisher``, ``BucketReader``, lazy ``DeltaSyncExtension``), the ``vllm.general_plugins``
entry point, every CLI verb, the stores, ``StepWatcher`` at its old path, every old flat module
path (``vllm_deltasync._moved.MOVED``) and every ``SyncConfig`` option with its
``VLLM_DELTASYNC_*`` variable. No vLLM engine is started; vLLM itself is never imported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import io
import json
import re
import sys
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "vllm_deltasync.server.vllm.plugin:register_plugin"
SHAPES = {"model.embed_tokens.weight": (64, 16), "model.layers.0.mlp.down_proj.weight": (16, 24),
          "model.norm.weight": (16,)}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in SHAPES.items()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)), k


@pytest.fixture
def bucket(tmp_path: Path) -> tuple[str, dict[int, dict[str, torch.Tensor]]]:
    """A ``file://`` bucket with steps 0 (anchor) and 1 (delta) published by ``DeltaPublisher``."""
    from vllm_deltasync import DeltaPublisher

    w = _weights(0)
    history = {0: {k: v.clone() for k, v in w.items()}}
    url = f"file://{tmp_path}/bucket"
    with DeltaPublisher(url, anchor_every=10) as pub:
        pub.publish(0, w)
        flat = w["model.layers.0.mlp.down_proj.weight"].view(-1)
        flat[::7] += 0.01
        history[1] = {k: v.clone() for k, v in w.items()}
        pub.publish(1, w.items())
    return url, history


def _read(url: str, step: int) -> tuple[list[int], Any, dict[str, torch.Tensor]]:
    from vllm_deltasync import BucketReader

    async def go() -> tuple[list[int], Any, dict[str, torch.Tensor]]:
        async with BucketReader.open(url) as reader:
            return (await reader.list_steps(), await reader.manifest(step),
                    await reader.read_full(step))

    return asyncio.run(go())


def _cli(*argv: str) -> tuple[int, str]:
    from vllm_deltasync.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


@contextlib.contextmanager
def _fresh(*names: str) -> Iterator[None]:
    """Forget ``names`` in ``sys.modules`` so importing them runs the alias finder again."""
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


# -- the package root -------------------------------------------------------------------------


def test_publisher_writes_what_the_reader_reads(
        bucket: tuple[str, dict[int, dict[str, torch.Tensor]]]) -> None:
    import vllm_deltasync
    from vllm_deltasync import BucketReader, DeltaPublisher, Manifest, open_store

    assert DeltaPublisher is vllm_deltasync.trainer.publisher.DeltaPublisher
    assert BucketReader is vllm_deltasync.format.reader.BucketReader
    assert open_store is vllm_deltasync.stores.open_store
    url, history = bucket
    steps, manifest, full = _read(url, 1)
    assert steps == [0, 1]
    assert isinstance(manifest, Manifest) and manifest.kind == "delta"
    assert manifest.base_step == 0 and manifest.totals.changed > 0
    _same(full, history[1])
    _same(_read(url, 0)[2], history[0])
    for name in vllm_deltasync.__all__:
        if name != "DeltaSyncExtension":
            assert getattr(vllm_deltasync, name) is not None, name


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_extension_resolves_lazily() -> None:
    import vllm_deltasync
    from vllm_deltasync.server.extension import DeltaSyncExtension

    assert vllm_deltasync.DeltaSyncExtension is DeltaSyncExtension
    assert callable(DeltaSyncExtension.deltasync_start)
    with pytest.raises(AttributeError):
        vllm_deltasync.NoSuchName  # noqa: B018


def test_vllm_plugin_entry_point() -> None:
    """vLLM loads ``deltasync`` from ``vllm.general_plugins`` in every process it starts."""
    from vllm_deltasync.server.extension import register_plugin

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared["vllm.general_plugins"]["deltasync"] == PLUGIN
    [ep] = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins")
            if e.name == "deltasync"]
    # An install made before the package was split still names the old path, which resolves
    # through the deprecated alias to the same function (reinstall to refresh the metadata).
    with _fresh("vllm_deltasync.extension"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        plugin = ep.load()
    assert ep.value in (PLUGIN, "vllm_deltasync.extension:register_plugin",
                        "vllm_deltasync.server.extension:register_plugin"), ep.value
    assert callable(plugin) and plugin is register_plugin


# -- the command line -------------------------------------------------------------------------


VERBS = ["inspect", "verify", "materialize", "status", "import-trl"]


def test_cli_lists_exactly_the_documented_verbs() -> None:
    from vllm_deltasync.cli import VERBS as table

    assert list(table) == VERBS


@pytest.mark.parametrize("verb", VERBS)
def test_cli_help(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_deltasync.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([verb, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"vllm-deltasync {verb}" in out and "unavailable" not in out


def test_cli_inspect_verify_materialize(
        bucket: tuple[str, dict[int, dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    url, history = bucket
    code, out = _cli("inspect", url)
    assert code == 0 and "2 steps, 1 anchors" in out, out
    code, out = _cli("inspect", url, "--json")
    doc = json.loads(out)
    assert code == 0 and [r["step"] for r in doc["steps"]] == [0, 1] and not doc["problems"]
    code, out = _cli("verify", url)
    assert code == 0, out
    code, _ = _cli("materialize", url, "--step", "1", "--out", str(tmp_path / "ckpt"))
    assert code == 0
    _same(load_file(str(tmp_path / "ckpt" / "model.safetensors")), history[1])


def test_cli_status() -> None:
    from vllm_deltasync.server import metrics

    m = metrics.SyncMetrics(bucket_url="file:///b", format_version=1)
    server = metrics.MetricsServer(m, port=0, addr="127.0.0.1")
    try:
        m.update([{"rank": 0, "applied_step": 4, "newest_step": 5, "last_error": None,
                   "applied_published_at": 100.0, "newest_published_at": 101.0}])
        code, out = _cli("status", f"127.0.0.1:{server.port}")
    finally:
        server.close()
    assert code == 0 and "applied=4 newest=5 behind=1" in out, out


def test_cli_import_trl(tmp_path: Path) -> None:
    """A TRL delta-sync bucket (anchor + absolute-value delta, no manifest) is converted."""
    w = _weights(1)
    src = tmp_path / "trl"
    (src / "anchors").mkdir(parents=True)
    (src / "deltas").mkdir()
    (src / "anchors" / "step_000000.safetensors").write_bytes(
        save(w, metadata={"format": "full", "model_version": "0"}))
    name = "model.norm.weight"
    idx = torch.tensor([1, 5, 9], dtype=torch.int32)
    w[name].view(torch.int16)[idx.long()] += 3
    total = sum(t.numel() for t in w.values())
    (src / "deltas" / "step_000001.safetensors").write_bytes(save(
        {f"{name}.indices": idx, f"{name}.values": w[name][idx.long()].clone()},
        metadata={"format": "sparse_weight_patch", "version": "1", "sparse": "true",
                  "model_version": "1", "sparsity": f"{1 - 3 / total:.6f}",
                  "changed_params": json.dumps([name]), "total_params": str(total),
                  "changed_elements": "3"}))
    dst = f"file://{tmp_path}/ours"
    code, out = _cli("import-trl", f"file://{src}", dst)
    assert code == 0 and "imported 2 steps (0..1)" in out, out
    _same(_read(dst, 1)[2], w)


# -- stores (docs/transports.md) --------------------------------------------------------------


def test_open_store_and_store_classes(tmp_path: Path) -> None:
    from vllm_deltasync.stores import open_store
    from vllm_deltasync.stores._retry import RetryPolicy
    from vllm_deltasync.stores.base import Store

    store = open_store(f"file://{tmp_path}/s")
    assert isinstance(store, Store)

    async def roundtrip() -> tuple[bytes, list[str]]:
        await store.write("manifests/x.json", b"{}")
        try:
            return await store.read("manifests/x.json"), [o.path for o in await store.list()]
        finally:
            await store.close()

    assert asyncio.run(roundtrip()) == (b"{}", ["manifests/x.json"])

    policy = RetryPolicy(attempts=3, base_delay_s=0.5, max_delay_s=2.0)
    assert all(0.0 <= policy.backoff_s(a) <= min(2.0, 0.5 * 2**a) for a in range(6))


def test_s3_store_hub_gateway() -> None:
    pytest.importorskip("aiobotocore")
    from vllm_deltasync.stores import open_store
    from vllm_deltasync.stores.base import Store
    from vllm_deltasync.stores.s3 import S3Store

    gateway = S3Store.hub_gateway("my-org", "rl-run", "policy-a")
    same = open_store("s3://rl-run/policy-a", endpoint_url="https://s3.hf.co/my-org",
                      region_name="us-east-1", addressing_style="path")
    assert isinstance(gateway, S3Store) and isinstance(same, S3Store)
    assert isinstance(gateway, Store)
    assert gateway.url == same.url == "s3://rl-run/policy-a"
    assert gateway.endpoint_url == same.endpoint_url == "https://s3.hf.co/my-org"


# -- old import paths -------------------------------------------------------------------------


def test_step_watcher_at_its_old_path(tmp_path: Path) -> None:
    from vllm_deltasync import DeltaPublisher
    from vllm_deltasync.server.worker.discovery import StepWatcher as NewStepWatcher
    from vllm_deltasync.stores import open_store

    with _fresh("vllm_deltasync.discovery"), \
            pytest.warns(DeprecationWarning, match="vllm_deltasync.server.worker.discovery"):
        from vllm_deltasync.discovery import StepWatcher
    assert StepWatcher is NewStepWatcher

    one = f"file://{tmp_path}/one-step"
    with DeltaPublisher(one) as pub:
        pub.publish(7, _weights(2))

    async def go() -> int | None:
        store = open_store(one)
        watcher = StepWatcher(store)
        try:
            return await watcher.wait_for_new(after=None, timeout_s=0.2)
        finally:
            await watcher.close()
            await store.close()

    assert asyncio.run(go()) == 7


def _moved() -> dict[str, str]:
    from vllm_deltasync._moved import MOVED

    return dict(MOVED)


@pytest.mark.parametrize(("old", "new"), sorted(_moved().items()))
def test_old_module_paths_warn_and_resolve(old: str, new: str) -> None:
    target = importlib.import_module(new)
    with _fresh(old), pytest.warns(DeprecationWarning, match=re.escape(new)):
        module = importlib.import_module(old)
    assert module is target
    assert module.__spec__ is not None and module.__spec__.name == new  # reload uses the new path


# -- configuration ----------------------------------------------------------------------------

# One non-default value per option: (environment string, value expected in the field).
SAMPLES: dict[str, tuple[str, Any]] = {
    "url": ("s3://key:secret@bucket/prefix", "s3://key:secret@bucket/prefix"),
    "drafter_url": ("file:///tmp/draft-bucket", "file:///tmp/draft-bucket"),
    "drafter_prefix": ("eagle.", "eagle."),
    "poll_interval_s": ("0.5", 0.5),
    "download_concurrency": ("3", 3),
    "max_staged_bytes": ("1048576", 1 << 20),
    "max_device_staged_bytes": ("0", 0),
    "on_start": ("wait", "wait"),
    "loaded_step": ("41", 41),
    "in_flight": ("drain", "drain"),
    "reset_prefix_cache": ("false", False),
    "max_chain": ("9", 9),
    "max_drain_wait_s": ("2.5", 2.5),
    "update_wait_s": ("30", 30.0),
    "min_version_wait_s": ("1.5", 1.5),
    "metrics_port": ("0", 0),
    "metrics_host": ("127.0.0.1", "127.0.0.1"),
    "debug_ring_size": ("17", 17),
    "node_cache": ("off", "off"),
    "node_cache_dir": ("/tmp/deltasync-cache", "/tmp/deltasync-cache"),
    "cpu_kernels": ("inplace", "inplace"),
    "decoder": ("numpy", "numpy"),
    "staging_cpus": ("2-3", "2-3"),
    "mirror_urls": ("http://cache-a:8080/run, http://cache-b:8080/run",
                    ("http://cache-a:8080/run", "http://cache-b:8080/run")),
    "fetch_jitter_s": ("1.5", 1.5),
    "store_options": ('{"addressing_style": "path"}', {"addressing_style": "path"}),
}


def _readme_options() -> dict[str, str]:
    """option -> env variable, from the README's configuration table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Configuration\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "README.md has no '## Configuration' section"
    return dict(re.findall(r"^\| `([a-z_]+)` \| `(VLLM_DELTASYNC_[A-Z_]+)` \|",
                           section.group(1), re.M))


def test_every_option_is_documented_and_sampled() -> None:
    from vllm_deltasync.config import SyncConfig, env_name

    fields = [f.name for f in dataclasses.fields(SyncConfig)]
    assert sorted(SAMPLES) == sorted(fields), "add a sample value for each SyncConfig field"
    assert _readme_options() == {n: env_name(n) for n in fields}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_option_parses_from_env_and_additional_config(name: str) -> None:
    from vllm_deltasync.config import SyncConfig, env_name

    raw, expected = SAMPLES[name]
    env = {env_name(name): raw}
    if name != "url":
        env["VLLM_DELTASYNC_URL"] = "file:///data/bucket"
    cfg = SyncConfig.from_sources({}, env)
    assert getattr(cfg, name) == expected
    assert type(getattr(cfg, name)) is type(expected)

    # the same option as a config key (JSON value); the variable wins over it
    key_value = expected if name != "url" else "file:///from/config"
    section: dict[str, Any] = {name: key_value}
    if name != "url":
        section["url"] = "file:///data/bucket"
    cfg = SyncConfig.from_sources({"deltasync": section}, {})
    assert getattr(cfg, name) == key_value
    cfg = SyncConfig.from_sources({"deltasync": section}, env)
    assert getattr(cfg, name) == expected


def test_all_options_at_once_and_secrets_hidden() -> None:
    from vllm_deltasync.config import SyncConfig

    together = {n: v for n, v in SAMPLES.items() if n != "drafter_prefix"}  # excludes drafter_url
    from vllm_deltasync.config import env_name

    env = {env_name(n): raw for n, (raw, _) in together.items()}
    cfg = SyncConfig.from_sources({}, env)
    for name, (_, expected) in together.items():
        assert getattr(cfg, name) == expected, name
    assert "secret" not in repr(cfg) and "addressing_style" not in repr(cfg)
    assert cfg.redacted_url() == "s3://bucket/prefix"


def test_the_drafters_two_sources_exclude_each_other() -> None:
    from vllm_deltasync.config import SyncConfig
    from vllm_deltasync.errors import ConfigError

    with pytest.raises(ConfigError, match="drafter_url and drafter_prefix are both set"):
        SyncConfig(url="file:///p", drafter_url="file:///d", drafter_prefix="eagle.")
    for bad in (" eagle.", ".", "eagle. "):
        with pytest.raises(ConfigError, match="drafter_prefix"):
            SyncConfig(url="file:///p", drafter_prefix=bad)
    own = SyncConfig(url="file:///p", drafter_url="file:///d", loaded_step=3).for_drafter()
    assert own.url == "file:///d" and own.loaded_step is None and not own.drafter_url
    shared = SyncConfig(url="file:///p", drafter_prefix="eagle.", loaded_step=3,
                        node_cache="on").for_drafter()
    assert shared.url == "file:///p" and shared.drafter_prefix == "eagle."
    assert shared.node_cache == "off" and shared.loaded_step is None
    assert not SyncConfig(url="file:///p").follows_drafter
    assert SyncConfig(url="file:///p", drafter_prefix="mtp.").follows_drafter
