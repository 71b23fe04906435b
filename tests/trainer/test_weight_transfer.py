"""The trainer side of weight-transfer backend ``deltasync``, against a file:// bucket and a
client that records the calls (no vLLM engine).

``WeightTransferTrainerFactory.trainer_init`` knows the backend once the module is imported
(and once vLLM's plugins are loaded: the package's plugin registers it by module path); the
sender checks the server's bucket at init; each ``send_weights`` publishes a step (anchors and
deltas as the publisher's ``anchor_every`` says), commits it, then calls ``start_weight_update``,
``update_weights({"step", "identity"})`` with the committed manifest's identity and
``finish_weight_update(weight_version=str(step))``, in that order. A rank other than 0 iterates
its source and calls nothing. A server error closes the update session and raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.engines import requires_vllm
from vllm_deltasync.format.layout import manifest_path
from vllm_deltasync.format.manifest import Manifest

pytestmark = requires_vllm


class Recorder:
    """A ``VLLMWeightSyncClient`` that records what it is asked."""

    def __init__(self, fail_update: BaseException | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_update = fail_update

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info: Any) -> None:
        self.calls.append(("update", update_info))
        if self.fail_update is not None:
            raise self.fail_update

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


class Counting(torch.nn.Module):
    """A model whose named parameters count how often they were iterated."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
        self.b = torch.nn.Linear(8, 4).to(torch.bfloat16)
        self.passes = 0

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.passes += 1
        return super().named_parameters(*args, **kwargs)


def _manifest(bucket: Path, step: int) -> Manifest:
    path = bucket / manifest_path(step)
    return Manifest.from_json(path.read_bytes(), source=str(path))


def test_send_weights_publishes_then_drives_the_server_in_order(tmp_path: Path) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_deltasync.trainer.weight_transfer import (
        DeltaSyncTrainerInitInfo,
        DeltaSyncTrainerWeightTransferEngine,
    )

    bucket = tmp_path / "bucket"
    url = f"file://{bucket}"
    model, client = Counting(), Recorder()
    engine = WeightTransferTrainerFactory.trainer_init(
        DeltaSyncTrainerInitInfo(url=url, rank=0, publisher_options={"anchor_every": 2}),
        client=client, source=ModuleSource(model))
    assert isinstance(engine, DeltaSyncTrainerWeightTransferEngine) and engine.is_sender
    assert client.calls == [("init", {"url": url})]
    try:
        steps = []
        for _ in range(3):
            with torch.no_grad():
                model.a.weight[0, :3] += 1
            steps.append(engine.send_weights())
        steps.append(engine.send_weights(7))  # an explicit step
    finally:
        engine.shutdown()

    assert steps == [0, 1, 2, 7]
    manifests = {s: _manifest(bucket, s) for s in steps}
    assert [manifests[s].kind for s in steps] == ["anchor", "delta", "anchor", "delta"]
    assert manifests[1].base_id == manifests[0].identity
    calls = client.calls[1:]
    assert len(calls) == 3 * len(steps)
    for i, step in enumerate(steps):
        assert calls[3 * i:3 * i + 3] == [
            ("start", None),
            ("update", {"step": step, "identity": manifests[step].identity}),
            ("finish", str(step)),
        ]
        assert manifests[step].identity is not None
    assert model.passes == len(steps)  # the source is iterated once per send


def test_other_ranks_iterate_their_source_and_call_nothing(tmp_path: Path) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource

    from vllm_deltasync.trainer.weight_transfer import (
        DeltaSyncTrainerInitInfo,
        DeltaSyncTrainerWeightTransferEngine,
    )

    model, client = Counting(), Recorder()
    engine = DeltaSyncTrainerWeightTransferEngine.trainer_init(
        DeltaSyncTrainerInitInfo(url=f"file://{tmp_path}/bucket", rank=1), client=client,
        source=ModuleSource(model))
    assert not engine.is_sender and engine.publisher is None
    assert engine.send_weights() is None and engine.send_weights() is None
    engine.shutdown()
    assert client.calls == [] and model.passes == 2
    assert not (tmp_path / "bucket").exists()


def test_a_server_error_closes_the_session_and_raises(tmp_path: Path) -> None:
    from vllm_deltasync.trainer.weight_transfer import (
        DeltaSyncTrainerInitInfo,
        DeltaSyncTrainerWeightTransferEngine,
    )

    client = Recorder(fail_update=RuntimeError("step 0 is not staged on every rank"))
    engine = DeltaSyncTrainerWeightTransferEngine.trainer_init(
        DeltaSyncTrainerInitInfo(url=f"file://{tmp_path}/bucket", rank=0,
                                 server_url="file:///mnt/bucket"), client=client)
    weights = [("w", torch.ones(4, 4, dtype=torch.bfloat16))]
    try:
        with pytest.raises(RuntimeError, match="step 0 is not staged"):
            engine.send_weights(named_tensors=weights)
        with pytest.raises(ValueError, match="no weights"):
            engine.send_weights()
    finally:
        engine.shutdown()
    assert client.calls[0] == ("init", {"url": "file:///mnt/bucket"})
    assert [c[0] for c in client.calls[1:]] == ["start", "update", "finish"]
    assert client.calls[-1] == ("finish", None)  # closed, no version
    assert _manifest(tmp_path / "bucket", 0).kind == "anchor"  # published before the call
