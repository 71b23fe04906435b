"""Writer tokens: a second writer on one prefix is detected and named (file:// and hf://), and
retention never deletes what another token wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.publishing import Trainer, bits_equal, data_dirs, manifest_steps, read_full
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.errors import PublishError

A, B = "aaaa0000aaaa0000", "bbbb1111bbbb1111"


@pytest.fixture(params=["file", "hf"])
def prefix(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "file":
        return f"file://{tmp_path}/bucket", {}
    store = request.getfixturevalue("make_hf_store")()
    hub = request.getfixturevalue("hub")
    return store.url, {"endpoint": hub.endpoint, "token": hub.token, "environ": {},
                       "uploader": store._uploader, "part_size": 1 << 16}


def test_second_live_writer_is_detected_and_named(prefix: tuple[str, dict[str, Any]]) -> None:
    url, options = prefix
    ta, tb = Trainer(seed=1), Trainer(seed=2)
    first = DeltaPublisher(url, anchor_every=10, writer_token=A, run_id="00000000000000a1",
                           store_options=options)
    try:
        for step in (0, 1):
            ta.step()
            first.publish(step, ta.weights)
        first.flush()
        with DeltaPublisher(url, anchor_every=10, writer_token=B, store_options=options) as second:
            tb.step()
            second.publish(2, tb.weights)  # starts after step 1: its first step is an anchor
        ta.step()
        first.publish(3, ta.weights)
        with pytest.raises(PublishError) as err:
            first.flush()
        msg = str(err.value)
        assert f"step 2 was committed by writer {B}" in msg and f"writer {A}" in msg
        assert "second writer" in msg
    finally:
        first._closed = True  # its error was surfaced; stop its thread without a retry
        first._uploader.stop()
    # readers still rebuild the other writer's step (it is an anchor of its own run)
    if not options:
        assert bits_equal(read_full(url, 2), tb.bf16())
        # the check runs while step 3 encodes, but no file of it is written before it passes
        assert not any(d.startswith("000000000003-") for d in data_dirs(Path(url[7:])))


def test_same_step_from_two_writers_is_refused_on_file(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    ta, tb = Trainer(seed=1), Trainer(seed=2)
    with DeltaPublisher(url, anchor_every=10, writer_token=A) as first:
        ta.step()
        first.publish(0, ta.weights)
    second = DeltaPublisher(url, anchor_every=10, writer_token=B)
    second._last_step = None  # a writer that started before step 0 was committed
    second._uploader._seen_step = None
    tb.step()
    second.publish(0, tb.weights)
    with pytest.raises(PublishError, match=f"writer {A}"):
        second.flush()
    second._closed = True
    second._uploader.stop()
    assert bits_equal(read_full(url, 0), ta.bf16())  # the first commit stands


def test_retention_leaves_another_writers_data_alone(prefix: tuple[str, dict[str, Any]], run: Any) -> None:
    url, options = prefix
    ta, tb = Trainer(seed=1), Trainer(seed=2)
    with DeltaPublisher(url, anchor_every=2, keep_anchors=1, writer_token=A,
                        store_options=options) as first:
        for step in range(4):
            ta.step()
            first.publish(step, ta.weights)

    from vllm_deltasync.stores import open_store

    async def listing() -> list[str]:
        async with open_store(url, **options) as store:
            return sorted(o.path for o in await store.list())

    before = run(listing())
    a_manifests = [p for p in before if p.startswith("manifests/")]
    assert a_manifests == [f"manifests/{s:012d}.json" for s in (2, 3)]  # A kept its newest anchor
    assert any(f"-{A}-" in p for p in before)
    with DeltaPublisher(url, anchor_every=2, keep_anchors=1, writer_token=B,
                        store_options=options) as second:
        for step in range(4, 12):
            tb.step()
            second.publish(step, tb.weights)
    after = run(listing())
    # every object of writer A is still there; writer B cleaned its own old steps
    assert [p for p in before if f"-{A}-" in p] == [p for p in after if f"-{A}-" in p]
    steps = sorted(int(p[len("manifests/"):-5]) for p in after if p.startswith("manifests/"))
    assert steps == [2, 3, 10, 11]  # A's, untouched; B's newest anchor and what follows
    assert not any(f"{s:012d}-{B}-" in p for p in after for s in range(4, 10))


def test_restart_with_the_same_token_cleans_its_own_orphans(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    root = tmp_path / "bucket"
    trainer = Trainer(seed=3)
    with DeltaPublisher(url, anchor_every=2, keep_anchors=1, writer_token=A) as pub:
        for step in range(3):
            trainer.step()
            pub.publish(step, trainer.weights)
    for token in (f"{A}-dead", f"{B}-dead"):  # killed attempts of step 2: ours and another's
        (root / "data" / f"{2:012d}-{token}").mkdir()
        (root / "data" / f"{2:012d}-{token}" / "00000.safetensors").write_bytes(b"x")
    with DeltaPublisher(url, anchor_every=2, keep_anchors=1, writer_token=A) as pub:
        for step in range(3, 5):
            trainer.step()
            pub.publish(step, trainer.weights)
    dirs = data_dirs(root)
    assert f"{2:012d}-{A}-dead" not in dirs and f"{2:012d}-{B}-dead" in dirs
    assert manifest_steps(root) == [3, 4]  # the anchor after the restart and its delta


def test_token_options_are_checked(tmp_path: Path) -> None:
    from vllm_deltasync.errors import ConfigError

    for bad in ({"writer_token": "XYZ"}, {"run_id": "12"}, {"format_version": 4}):
        with pytest.raises(ConfigError):
            DeltaPublisher(f"file://{tmp_path}/b", **bad)  # type: ignore[arg-type]

