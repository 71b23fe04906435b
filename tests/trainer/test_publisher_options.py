"""PublisherOptions: one frozen object holds every publisher option; keywords build or override it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.helpers.publishing import Trainer, manifest_steps, read_full
from vllm_deltasync import DeltaPublisher, PublisherOptions
from vllm_deltasync.errors import ConfigError


def test_keywords_and_an_options_object_configure_the_same_publisher(tmp_path: Path) -> None:
    trainer = Trainer()
    base = PublisherOptions(anchor_every=2, run_id="ab" * 8, timeout_s=30.0)
    with DeltaPublisher(f"file://{tmp_path}/a", base, resumed_from=3, writer_token="cd" * 8) as pub:
        assert pub.options == dataclasses.replace(base, resumed_from=3, writer_token="cd" * 8)
        assert (pub.run_id, pub.writer_token, pub.codec) == ("ab" * 8, "cd" * 8, "sparse-v3")
        for step in range(3):
            trainer.step()
            pub.publish(step, trainer.bf16())
    with DeltaPublisher(f"file://{tmp_path}/b", anchor_every=2, run_id="ab" * 8) as kw:
        assert kw.options == PublisherOptions(anchor_every=2, run_id="ab" * 8)
    assert manifest_steps(tmp_path / "a") == [0, 1, 2]
    assert read_full(f"file://{tmp_path}/a", 2).keys() == trainer.bf16().keys()
    assert base.resumed_from is None  # the options object given is not changed


def test_every_bad_option_is_a_config_error_naming_it(tmp_path: Path) -> None:
    bad: list[tuple[dict[str, object], str]] = [
        ({"anchor_every": 0}, "anchor_every=0"), ({"keep_anchors": True}, "keep_anchors=True"),
        ({"max_file_bytes": 100}, "max_file_bytes=100"), ({"max_pending_steps": 0}, "max_pending_steps"),
        ({"encode_threads": -1}, "encode_threads=-1"), ({"timeout_s": 0}, "timeout_s=0"),
        ({"format_version": 4}, "format_version=4"), ({"codec": "dense"}, "'dense' is dense"),
        ({"codec": "nope"}, "nope"), ({"run_id": "XY" * 4}, "run_id="),
        ({"writer_token": "12"}, "writer_token='12'"), ({"resumed_from": -1}, "resumed_from=-1"),
        ({"previous_on": "gpu"}, "previous_on='gpu'"), ({"store_options": [1]}, "store_options"),
        ({"on_commit": 3}, "on_commit"), ({"lora": "adapters"}, "lora='adapters'"),
        ({"lora": "adapter", "format_version": 1}, "lora='adapter' needs format_version 2 or 3"),
    ]
    for fields, match in bad:
        with pytest.raises(ConfigError, match=match):
            PublisherOptions(**fields)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=match):
            DeltaPublisher(f"file://{tmp_path}/b", **fields)
    assert not (tmp_path / "b").exists()  # refused before the store was opened


def test_unknown_keywords_and_options_types_are_type_errors(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['anchor_evry'\]"):
        DeltaPublisher(f"file://{tmp_path}/b", anchor_evry=3)
    with pytest.raises(TypeError, match="must be a PublisherOptions"):
        DeltaPublisher(f"file://{tmp_path}/b", {"anchor_every": 3})  # type: ignore[arg-type]


def test_options_are_frozen_and_hide_store_credentials() -> None:
    options = PublisherOptions(store_options={"secret_access_key": "hunter2"})
    assert "hunter2" not in repr(options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.anchor_every = 3  # type: ignore[misc]
    assert PublisherOptions(format_version=1).delta_codec == "sparse-v2"
    assert PublisherOptions(codec="sparse-v1").delta_codec == "sparse-v1"
