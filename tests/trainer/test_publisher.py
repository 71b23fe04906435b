"""DeltaPublisher: bit-exact chains, anchors, input checks, back-pressure, errors, retention."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.publishing import (
    GATED,
    GatedStore,
    Trainer,
    bits_equal,
    data_dirs,
    manifest_steps,
    publish_run,
    read_full,
)
from vllm_deltasync import BucketReader, DeltaPublisher
from vllm_deltasync.errors import ConfigError, PublishError, TransientStoreError
from vllm_deltasync.stores import register_store

register_store("gated", *GATED)


def manifests(url: str) -> dict[int, object]:
    async def go() -> dict[int, object]:
        async with BucketReader.open(url) as r:
            return {s: await r.manifest(s) for s in await r.list_steps()}

    return asyncio.run(go())


def test_forty_steps_rebuild_bit_for_bit_at_every_step(bucket: str) -> None:
    truth = publish_run(bucket, range(40), Trainer(), anchor_every=10, keep_anchors=10)
    ms = manifests(bucket)
    assert sorted(ms) == list(range(40))
    assert [s for s, m in ms.items() if m.kind == "anchor"] == [0, 10, 20, 30]  # type: ignore[attr-defined]
    densities = [m.totals.changed / m.totals.elements for s, m in ms.items() if m.kind == "delta"]  # type: ignore[attr-defined]
    assert 0.002 < sum(densities) / len(densities) < 0.05  # an RL-like ~1% of elements change
    for step in range(40):
        assert bits_equal(read_full(bucket, step), truth[step]), f"step {step} differs"


def test_split_files_and_tensors_spanning_files(bucket: str) -> None:
    truth = publish_run(bucket, range(4), Trainer(lr=3e-4), anchor_every=3, max_file_bytes=2048)
    ms = manifests(bucket)
    anchor = ms[0]
    assert len(anchor.files) > 5  # type: ignore[attr-defined]
    embed = anchor.tensor("model.embed_tokens.weight")  # type: ignore[attr-defined]
    assert len({c.file for c in embed.chunks}) > 1
    assert all(f.size <= 2048 + 1024 for f in anchor.files)  # type: ignore[attr-defined]
    for step in range(4):
        assert bits_equal(read_full(bucket, step), truth[step])


def test_accepts_module_parameters_any_dtype_and_snapshots_them(bucket: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    truth = {}
    with DeltaPublisher(bucket, anchor_every=100) as pub:
        for step in range(3):
            model(torch.randn(4, 16, dtype=torch.bfloat16)).square().sum().backward()
            opt.step()
            opt.zero_grad()
            pub.publish(step, model.named_parameters())
            truth[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
            with torch.no_grad():  # the trainer mutates its weights right after publishing
                for p in model.parameters():
                    p.add_(1.0)
        pub.flush()
        assert pub.stats.steps == 3 and pub.stats.anchors == 1
    for step in range(3):
        assert bits_equal(read_full(bucket, step), truth[step])


def test_steps_must_increase_and_restart_continues_with_an_anchor(bucket: str) -> None:
    trainer = Trainer()
    publish_run(bucket, [0, 1, 2], trainer, anchor_every=10)
    with DeltaPublisher(bucket) as pub:
        assert pub.last_step == 2
        for bad in (2, 1):
            with pytest.raises(PublishError, match=f"step {bad}: steps must increase.*newest step .* is 2"):
                pub.publish(bad, trainer.weights)
        trainer.step()
        pub.publish(5, trainer.weights)
        with pytest.raises(PublishError, match="steps must increase"):
            pub.publish(5, trainer.weights)
        trainer.step()
        pub.publish(6, trainer.weights)
    ms = manifests(bucket)
    assert ms[5].kind == "anchor" and ms[6].base_step == 5  # type: ignore[attr-defined]
    assert bits_equal(read_full(bucket, 6), trainer.bf16())


def test_bad_input_names_the_tensor_and_the_fix(bucket: str) -> None:
    w = Trainer().weights
    with DeltaPublisher(bucket) as pub:
        with pytest.raises(PublishError, match="'counter' is torch.int64; only floating-point"):
            pub.publish(0, {**w, "counter": torch.zeros(3, dtype=torch.int64)})
        with pytest.raises(PublishError, match="no tensors"):
            pub.publish(0, {})
        with pytest.raises(PublishError, match="'lm_head.weight' is given twice"):
            pub.publish(0, [("lm_head.weight", w["lm_head.weight"])] * 2)
        pub.publish(0, w)
        with pytest.raises(PublishError, match=r"parameter set changed.*missing: \['lm_head.weight'\]"):
            pub.publish(1, {k: v for k, v in w.items() if k != "lm_head.weight"})
        with pytest.raises(PublishError, match="new: \\['extra'\\]"):
            pub.publish(1, {**w, "extra": torch.zeros(2)})
        with pytest.raises(PublishError, match="'lm_head.weight' is torch.float32 \\[32, 96\\], it was torch.float32 \\[96, 32\\]"):
            pub.publish(1, {**w, "lm_head.weight": w["lm_head.weight"].t()})
        with pytest.raises(PublishError, match="'lm_head.weight' is torch.float16"):
            pub.publish(1, {**w, "lm_head.weight": w["lm_head.weight"].half()})
        pub.publish(1, w)  # the failed calls changed nothing
    assert manifest_steps(Path(bucket[7:])) == [0, 1]
    for kwargs in ({"anchor_every": 0}, {"keep_anchors": 0}, {"codec": "dense"}, {"codec": "nope"}):
        with pytest.raises(ConfigError):
            DeltaPublisher(bucket, **kwargs)  # type: ignore[arg-type]


def test_bounded_queue_back_pressures(tmp_path: Path) -> None:
    gate = GatedStore.GATES["bp"] = threading.Event()
    url = f"gated://bp{tmp_path}/bucket"
    trainer = Trainer()
    pub = DeltaPublisher(url, max_pending_steps=1)
    try:
        pub.publish(0, trainer.weights)  # taken by the upload thread, held at the gate
        time.sleep(0.2)
        pub.publish(1, trainer.weights)  # fills the queue
        third = threading.Thread(target=pub.publish, args=(2, trainer.weights))
        third.start()
        third.join(0.5)
        assert third.is_alive(), "publish did not wait for the full queue"
        gate.set()
        third.join(10)
        assert not third.is_alive()
        pub.flush()
        assert pub.stats.steps == 3
    finally:
        gate.set()
        pub.close()
        del GatedStore.GATES["bp"]


def test_failed_manifest_write_hides_the_step_and_next_is_an_anchor(tmp_path: Path) -> None:
    GatedStore.FAIL_MANIFEST["fm"] = 2
    url = f"gated://fm{tmp_path}/bucket"
    trainer = Trainer()
    with DeltaPublisher(url, anchor_every=10) as pub:
        for step in range(3):
            trainer.step()
            pub.publish(step, trainer.weights)
        pub._uploader.join()  # let the upload thread reach the failure
        trainer.step()
        with pytest.raises(TransientStoreError, match="injected failure"):
            pub.publish(3, trainer.weights)
        pub.publish(4, trainer.weights)
        pub.flush()
    root = tmp_path / "bucket"
    assert manifest_steps(root) == [0, 1, 4]
    # the data of step 2 was written but never committed; retention after anchor 4 removed it
    assert not any(d.startswith("000000000002-") for d in data_dirs(root))
    assert GatedStore.FAIL_MANIFEST == {}
    ms = manifests(f"file://{root}")
    assert ms[4].kind == "anchor"  # type: ignore[attr-defined]
    assert bits_equal(read_full(f"file://{root}", 4), trainer.bf16())


def test_retention_keeps_the_newest_chains_and_drops_orphans(bucket: str) -> None:
    root = Path(bucket[7:])
    trainer = Trainer()
    token = "5eed5eed5eed5eed"  # a restart of the same job resumes its writer token
    publish_run(bucket, range(5), trainer, anchor_every=3, keep_anchors=2, writer_token=token)
    (root / "data" / "000000000003-dead").mkdir()
    (root / "data" / "000000000003-dead" / "00000.safetensors").write_bytes(b"killed attempt")
    (root / "data" / "000000000099-beef").mkdir()  # a newer, in-flight attempt: kept
    (root / "data" / "000000000099-beef" / "00000.safetensors").write_bytes(b"in flight")
    truth = {}
    with DeltaPublisher(bucket, anchor_every=3, keep_anchors=2, writer_token=token) as pub:
        for step in range(5, 20):
            trainer.step()
            pub.publish(step, trainer.weights)
            truth[step] = trainer.bf16()
            pub.flush()
            steps = manifest_steps(root)
            ms = manifests(bucket)
            anchors = [s for s in steps if ms[s].kind == "anchor"]  # type: ignore[attr-defined]
            assert len(anchors) <= 3 and steps[0] == anchors[0]
            assert bits_equal(read_full(bucket, step), truth[step])
            assert steps == list(range(steps[0], step + 1))
    assert anchors == [14, 17] and steps == list(range(14, 20))
    dirs = data_dirs(root)
    assert len(dirs) == 7 and "000000000003-dead" not in dirs and "000000000099-beef" in dirs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("previous_on", ["device", "host"])
def test_publishes_tensors_on_the_gpu(bucket: str, previous_on: str) -> None:
    trainer = Trainer()
    with DeltaPublisher(bucket, anchor_every=3, previous_on=previous_on) as pub:
        for step in range(5):
            trainer.step()
            pub.publish(step, {k: v.to("cuda") for k, v in trainer.weights.items()})
            pub.flush()
            assert bits_equal(read_full(bucket, step), trainer.bf16())


def test_relative_codec_rebuilds_bit_for_bit(bucket: str) -> None:
    from vllm_deltasync.errors import FormatError
    from vllm_deltasync.format.codecs import get_codec

    try:
        get_codec("sparse-v2")
    except FormatError:
        pytest.skip("sparse-v2 is not available")
    truth = publish_run(bucket, range(8), Trainer(), anchor_every=4, codec="sparse-v2",
                        max_file_bytes=4096)
    ms = manifests(bucket)
    assert {m.tensors[0].encoding for m in ms.values() if m.kind == "delta"} == {"sparse-v2"}  # type: ignore[attr-defined]
    for step in range(8):
        assert bits_equal(read_full(bucket, step), truth[step])
