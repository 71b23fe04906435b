"""Retention deletes only its own writer's steps (and old v1 anonymous ones): never another
writer's, another format's (a v1 publisher and a v3 one on one prefix), nor a manifest nobody
could parse (issue 23, item 1)."""

from __future__ import annotations

import uuid
from pathlib import Path

from tests.helpers.publishing import Trainer, bits_equal, data_dirs, manifest_steps, read_full
from vllm_deltasync import DeltaPublisher
from vllm_deltasync._loop import default_loop
from vllm_deltasync.format.writer import retain
from vllm_deltasync.stores import open_store

A, B = "aaaa0000aaaa0000", "bbbb1111bbbb1111"


def _publish(url: str, steps: range, trainer: Trainer, **options: object) -> dict[int, object]:
    truth = {}
    with DeltaPublisher(url, anchor_every=2, keep_anchors=1, **options) as pub:  # type: ignore[arg-type]
        for step in steps:
            trainer.step()
            pub.publish(step, trainer.weights)
            truth[step] = trainer.bf16()
    return truth


def _plant(root: Path, step: int, token: str) -> str:
    """A data folder of a killed attempt (an orphan) under ``token``."""
    folder = root / "data" / f"{step:012d}-{token}"
    folder.mkdir(parents=True)
    (folder / "00000.safetensors").write_bytes(b"x")
    return folder.name


def test_a_v1_publisher_leaves_a_v3_writers_steps_and_data_alone(tmp_path: Path) -> None:
    root, url = tmp_path / "bucket", f"file://{tmp_path}/bucket"
    ta, t1 = Trainer(seed=1), Trainer(seed=2)
    truth_a = _publish(url, range(4), ta, writer_token=A)
    assert manifest_steps(root) == [2, 3]
    a_dirs = [d for d in data_dirs(root) if f"-{A}-" in d]
    a_orphan = _plant(root, 3, f"{A}-0123456789abcdef")  # A's killed attempt: A's to clean
    v1_orphan = _plant(root, 5, "00c0ffee00c0ffee")  # a v1 killed attempt: the v1 writer's
    _publish(url, range(4, 12), t1, format_version=1)
    dirs = data_dirs(root)
    # A's manifests, data and orphan survive; the v1 writer kept its newest anchor and cleaned
    # its own old steps and the v1 orphan
    assert manifest_steps(root) == [2, 3, 10, 11]
    assert set(a_dirs) | {a_orphan} <= set(dirs)
    assert v1_orphan not in dirs
    assert not any(d.startswith(f"{s:012d}-") for d in dirs for s in range(4, 10))
    assert bits_equal(read_full(url, 3), truth_a[3])  # A's chain still rebuilds


def test_a_v3_writer_deletes_old_v1_steps_but_not_another_v3_writers(tmp_path: Path) -> None:
    root, url = tmp_path / "bucket", f"file://{tmp_path}/bucket"
    _publish(url, range(4), Trainer(seed=1), format_version=1)  # v1: 2, 3 stay
    _publish(url, range(4, 8), Trainer(seed=2), writer_token=A)  # A: 6, 7 stay; v1 2, 3 go
    assert manifest_steps(root) == [6, 7]
    b_orphan = _plant(root, 7, f"{B}-0123456789abcdef")  # B's killed attempt: never A's
    truth_b = _publish(url, range(8, 14), Trainer(seed=3), writer_token=B)
    assert manifest_steps(root) == [6, 7, 12, 13]
    assert b_orphan not in data_dirs(root)  # B cleaned its own orphan
    a_orphan = _plant(root, 13, f"{A}-0123456789abcdef")
    truth_a = _publish(url, range(14, 18), Trainer(seed=4), writer_token=A)
    # A ran retention again: B's steps and data stay, A kept only its newest anchor
    assert manifest_steps(root) == [12, 13, 16, 17]
    dirs = data_dirs(root)
    assert a_orphan not in dirs
    assert sum(f"-{B}-" in d for d in dirs) == 2 and sum(f"-{A}-" in d for d in dirs) == 2
    assert bits_equal(read_full(url, 13), truth_b[13])
    assert bits_equal(read_full(url, 17), truth_a[17])


def test_unreadable_or_misnamed_manifests_and_their_data_are_never_deleted() -> None:
    """memory://: a garbage manifest, a manifest holding another step, and the data of their
    steps survive a v1 and a v3 writer's retention, however old."""
    url = f"memory://retention-owners-{uuid.uuid4().hex[:8]}"
    loop = default_loop()
    store = open_store(url)
    try:
        t = Trainer(seed=5)
        _publish(url, range(2), t, writer_token=A)  # A: anchor 0, delta 1
        loop.run(store.write("manifests/000000000000.json", b"not json", overwrite=True), 30)
        loop.run(store.write("data/000000000000-00c0ffee/00000.safetensors", b"v1?"), 30)
        m1 = loop.run(store.read("manifests/000000000001.json"), 30)
        _publish(url, range(2, 6), t, format_version=1)  # v1: anchors 2, 4; deletes 2, 3
        steps = sorted(int(o.path[10:22]) for o in loop.run(store.list("manifests/"), 30))
        assert steps == [0, 1, 4, 5]  # A's step 1 and the garbage step 0 survive the v1 writer
        _publish(url, range(6, 10), t, writer_token=A)  # A: anchors 6, 8; deletes 1, 2, 3
        loop.run(store.write("manifests/000000000003.json", m1), 30)  # step 1's, named 3
        loop.run(store.write("data/000000000003-0badcafe/00000.safetensors", b"v1?"), 30)
        kept = {"manifests/000000000000.json", "manifests/000000000003.json",
                "data/000000000000-00c0ffee/00000.safetensors",
                "data/000000000003-0badcafe/00000.safetensors"}
        for writer in (None, A):
            known: dict[int, tuple[str, frozenset[str], str | None]] = {}
            deleted = loop.run(retain(store, 1, known, writer=writer), 30)
            paths = {o.path for o in loop.run(store.list(), 30)}
            assert kept <= paths and not kept & set(deleted), writer
            assert 0 not in known and 3 not in known  # unknown owner: never anybody's
        steps = sorted(int(p[10:22]) for p in paths if p.startswith("manifests/"))
        assert steps == [0, 3, 8, 9]  # v1's 4, 5 went with A's cutoff (v1, older than 8)
    finally:
        loop.run(store.close(), 30)
