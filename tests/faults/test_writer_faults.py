"""Fault matrix, two publishers on one hf:// bucket (item 3). hf:// has no atomic conditional
write, so there the guarantee is detection, not prevention (docs/format.md, "Two writers"):
the writer that finds another token's step stops with an error naming both within one step,
retention never deletes the other token's data, and readers never mix the two runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.helpers.publishing import Trainer, bits_equal
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.errors import PublishError
from vllm_deltasync.format.reader import BucketReader

A, B = "aaaa0000aaaa0000", "bbbb1111bbbb1111"


def _scenario(store: Any, hub: Any) -> dict[str, Any]:
    """A (anchor every 2, keep 1) publishes 0, 1; B starts on the same prefix and publishes 2;
    A publishes 3 (and must stop); B goes on to 7 with retention running."""
    options = {"endpoint": hub.endpoint, "token": hub.token, "environ": {},
               "uploader": store._uploader, "part_size": 1 << 16}
    ta, tb = Trainer(seed=1), Trainer(seed=2)
    truth: dict[int, Any] = {}
    first = DeltaPublisher(store.url, anchor_every=2, keep_anchors=1, writer_token=A,
                           store_options=options)
    for step in (0, 1):
        ta.step()
        first.publish(step, ta.weights)
        truth[step] = ta.bf16()
    first.flush()
    a_files = sorted(p for p in hub.buckets[store.bucket_id] if f"-{A}-" in p)
    second = DeltaPublisher(store.url, anchor_every=2, keep_anchors=1, writer_token=B,
                            store_options=options)
    tb.step()
    second.publish(2, tb.weights)
    truth[2] = tb.bf16()
    second.flush()
    ta.step()
    first.publish(3, ta.weights)
    error = None
    try:
        first.flush()
    except PublishError as exc:
        error = exc
    finally:
        first._closed = True
        first._uploader.stop()
    for step in range(4, 8):
        tb.step()
        second.publish(step, tb.weights)
        truth[step] = tb.bf16()
    second.close()
    return {"error": error, "a_files": a_files, "truth": truth,
            "options": {k: v for k, v in options.items() if k != "uploader"}}


@pytest.fixture
def two_writers(hub: Any, make_hf_store: Any) -> tuple[Any, dict[str, Any]]:
    store = make_hf_store()
    return store, _scenario(store, hub)


def test_second_writer_on_hf_is_named_within_one_step(two_writers: tuple[Any, dict[str, Any]]) -> None:
    _, out = two_writers
    msg = str(out["error"])
    assert out["error"] is not None, "writer A published over writer B without an error"
    assert f"writer {B}" in msg and f"writer {A}" in msg and "step 2" in msg


def test_neither_writer_deletes_the_others_data(two_writers: tuple[Any, dict[str, Any]], hub: Any) -> None:
    store, out = two_writers
    objects = hub.buckets[store.bucket_id]
    assert out["a_files"] and all(p in objects for p in out["a_files"])  # B's retention ran
    assert any(f"-{B}-" in p for p in objects)


def test_readers_never_mix_two_runs(two_writers: tuple[Any, dict[str, Any]]) -> None:
    store, out = two_writers

    async def check() -> None:
        async with BucketReader.open(store.url, store_options=out["options"]) as reader:
            steps = await reader.list_steps()
            assert 3 not in steps or (await reader.manifest(3)).writer == A
            for step in steps:
                chain = await reader.plan(None, step)
                assert len({m.run_id for m in chain}) == 1, f"step {step} mixes runs"
                assert len({m.writer for m in chain}) == 1
                if step in out["truth"] and chain[-1].writer == B:
                    assert bits_equal(await reader.read_full(step), out["truth"][step])

    asyncio.run(check())
