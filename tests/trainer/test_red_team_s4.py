"""Issue 36, row S4 (data loss): the publisher committed steps that every reader refuses, and
``publish()``/``flush()`` returned ok. Each case is now refused before anything is written, with
an error naming the object and the fix; the bucket is left exactly as it was and the publisher
(for a tensor case) publishes the next good step.

Every test here fails on 65f3ef5 (the parent of the fix): there the constructor accepts the
``resumed_from`` and ``publish`` accepts the tensor, so ``pytest.raises`` fails.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.helpers.publishing import Trainer, bits_equal, manifest_steps, read_full
from vllm_deltasync import BucketReader, DeltaPublisher
from vllm_deltasync.errors import ConfigError, PublishError


def _objects(root: Path) -> dict[str, bytes]:
    """Every object of a ``file://`` bucket, path -> bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _verify(url: str) -> list[str]:
    async def go() -> list[str]:
        async with BucketReader.open(url) as reader:
            return await reader.verify()

    return asyncio.run(go())


def _restart_with(tmp_path: Path, resumed_from: int) -> None:
    """A bucket at step 3 (a server follows it there); the trainer restarts from a checkpoint
    and passes ``resumed_from``: refused at construction, the bucket unchanged and readable."""
    root = tmp_path / "bucket"
    url = f"file://{root}"
    trainer = Trainer()
    with DeltaPublisher(url, anchor_every=10) as pub:
        for step in range(4):
            trainer.step()
            pub.publish(step, trainer.bf16())
    before = _objects(root)
    with pytest.raises(ConfigError, match=r"resumed_from=\d+ is outside \[0, 999999999999\].*pass "
                                          "the training step of the checkpoint"):
        DeltaPublisher(url, resumed_from=resumed_from)
    assert _objects(root) == before  # nothing written, nothing deleted
    assert _verify(url) == []
    assert bits_equal(read_full(url), trainer.bf16())  # step 3 still materializes
    with DeltaPublisher(url, resumed_from=2) as pub:  # the fix the message names works
        trainer.step()
        pub.publish(pub.next_step, trainer.bf16())
    assert manifest_steps(root) == [0, 1, 2, 3, 4]
    assert _verify(url) == [] and bits_equal(read_full(url), trainer.bf16())


def test_S4_resumed_from_2_pow_70(tmp_path: Path) -> None:
    _restart_with(tmp_path, 2**70)


def test_S4_resumed_from_10_pow_13(tmp_path: Path) -> None:
    _restart_with(tmp_path, 10**13)


def _refused_tensor(tmp_path: Path, name: str, tensor: torch.Tensor, match: str) -> None:
    """A step holding one bad tensor among good ones: PublishError naming it and the fix,
    nothing written; the same publisher then commits the good step."""
    root = tmp_path / "bucket"
    url = f"file://{root}"
    trainer = Trainer()
    trainer.step()
    good = trainer.bf16()
    with DeltaPublisher(url, anchor_every=10) as pub:
        with pytest.raises(PublishError, match=match):
            pub.publish(0, {**good, name: tensor})
        pub.flush()  # nothing was queued: flush neither fails nor writes
        assert _objects(root) == {}
        pub.publish(0, good)
    assert manifest_steps(root) == [0]
    assert _verify(url) == [] and bits_equal(read_full(url), good)


def test_S4_tensor_name_empty(tmp_path: Path) -> None:
    _refused_tensor(tmp_path, "", torch.zeros(4), r"step 0: tensor '' has an empty name.*nothing "
                    r"of step 0 was published: publish it under a name of 1 to 1024 characters")


def test_S4_tensor_name_holds_nul(tmp_path: Path) -> None:
    _refused_tensor(tmp_path, "model.layers.0\x00.weight", torch.zeros(4),
                    r"tensor 'model.layers.0\\x00.weight' has a name holding NUL.*without NUL")


def test_S4_tensor_name_over_1024_characters(tmp_path: Path) -> None:
    _refused_tensor(tmp_path, "w" * 1025, torch.zeros(4),
                    r"has a name of 1025 characters, more than 1024.*1 to 1024 characters")


def test_S4_tensor_with_9_dimensions(tmp_path: Path) -> None:
    _refused_tensor(tmp_path, "model.odd.weight", torch.zeros((1, 2) * 4 + (3,)),
                    r"tensor 'model.odd.weight' has 9 dimensions, more than 8.*reshape it")
