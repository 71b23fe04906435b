"""Weight-transfer backend ``deltasync``, engine-core and worker sides, without an engine.

The coordinator in trainer-driven mode (``Coordinator(trainer_driven=True)``) on the stand-in
engine and ranks of tests/helpers/fake_engine.py: ticks never switch; ``update_to`` waits until
every rank has the step staged and switches every rank as a tick would; the same step again is
a no-op; an older step, a step applied with another identity, a step not staged in time, a
switch taken back, a coordinator that refused: each a ``WeightUpdateRefused`` naming the step.
The engine-core hook (``collective_rpc("update_weights")`` taken, the rest passed on), the
update-info parsing, the refusal when another backend is configured with a bucket, and the
worker-side receiver (bucket check at init, a clear error when it is reached at all).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers.engines import requires_vllm
from tests.helpers.fake_engine import FakeEngine as Engine
from tests.helpers.fake_engine import FakeRank as Rank
from tests.helpers.fake_engine import make_coordinator
from vllm_deltasync.server.engine import trainer
from vllm_deltasync.server.engine.admission import EngineFacts, coordinator_config
from vllm_deltasync.server.engine.coordinator import Coordinator
from vllm_deltasync.server.engine.trainer import WeightUpdateRefused
from vllm_deltasync.server.messages import RankStatus, TargetStatus
from vllm_deltasync.server.vllm import engine as engine_glue


def driven(ranks: list[Rank], **config: Any) -> tuple[Coordinator, Engine]:
    return make_coordinator(ranks, trainer_driven=True, **config)


def test_ticks_stage_but_never_switch() -> None:
    coord, engine = driven([Rank(0), Rank(1)])
    for _ in range(3):
        coord.tick()
    assert {r.applied for r in engine.ranks} == {2} and engine.version == "2"
    assert "deltasync_apply" not in engine.calls and coord.failed_ticks == 0


def test_update_switches_every_rank_then_the_same_step_is_a_no_op() -> None:
    coord, engine = driven([Rank(0, ready=(3, 4)), Rank(1, ready=(3, 4))])
    out = coord.update_to(3, "sha256:3")
    assert out["switched"] is True and out["step"] == 3
    assert {(r.applied, r.weights, r.pending) for r in engine.ranks} == {(3, 3, None)}
    assert engine.version == "3" and engine.prefix_resets == 0  # salted, not dropped
    assert coord.kv.identities == {"policy": "sha256:3"}
    assert coord.primary.switches[-1].identity == "sha256:3"
    assert coord.update_to(3, "sha256:3") == {"step": 3, "identity": "sha256:3",
                                              "switched": False}
    assert coord.update_to(4)["switched"] is True  # identity None: steps only
    assert engine.version == "4" and engine.calls.count("deltasync_apply") == 2


def test_update_waits_until_every_rank_staged_the_step() -> None:
    coord, engine = driven([Rank(0, ready=()), Rank(1, ready=())])

    def stage() -> None:
        time.sleep(0.3)
        for r in engine.ranks:
            r.ready.append(3)

    t = threading.Thread(target=stage)
    t.start()
    started = time.monotonic()
    out = coord.update_to(3, "sha256:3", wait_s=10)
    t.join()
    assert out["switched"] and 0.25 < time.monotonic() - started < 5
    assert {r.applied for r in engine.ranks} == {3}


def test_update_refusals_name_the_step() -> None:
    coord, engine = driven([Rank(0, ready=(3,)), Rank(1, ready=(3,))], update_wait_s=0.2)
    with pytest.raises(WeightUpdateRefused, match=r"step 1 refused: .*applied step 2, which is "
                                                  r"newer"):
        coord.update_to(1)
    with pytest.raises(WeightUpdateRefused, match="step 2 of another manifest"):
        coord.update_to(2, "sha256:someone-else")
    started = time.monotonic()
    with pytest.raises(WeightUpdateRefused, match=r"step 5 is not staged on every rank after "
                                                  r"0.2s \(update_wait_s\).*rank 1: applied=2"):
        coord.update_to(5)
    assert time.monotonic() - started < 3
    with pytest.raises(WeightUpdateRefused, match="step 3 with identity sha256:other is not "
                                                  "staged"):
        coord.update_to(3, "sha256:other", wait_s=0.1)  # a delta never applies onto other weights
    with pytest.raises(WeightUpdateRefused, match="must be an integer"):
        coord.update_to("3")
    assert {r.applied for r in engine.ranks} == {2} and engine.version == "2"


def test_a_switch_taken_back_fails_the_update_and_keeps_the_version() -> None:
    ranks = [Rank(0), Rank(1)]
    coord, engine = driven(ranks)
    ranks[1].fail["deltasync_apply"] = lambda: (_ for _ in ()).throw(RuntimeError("disk gone"))
    with pytest.raises(WeightUpdateRefused, match=r"update_weights to step 3 failed: .*disk gone"):
        coord.update_to(3, "sha256:3")
    assert engine.version == "2" and {r.weights for r in ranks} == {2}


def test_a_refused_coordinator_says_why() -> None:
    coord, _ = driven([Rank(0)])
    coord.active, coord.last_error = False, "rank 0: the startup proof failed"
    with pytest.raises(WeightUpdateRefused, match="does not follow on this server: rank 0: the "
                                                  "startup proof failed"):
        coord.update_to(3)


# ------------------------------------------------------------------------- engine-core hook


class _Core:
    """An engine core's ``collective_rpc`` (vLLM's, recorded) and its coordinator."""

    def __init__(self, coord: Any) -> None:
        self.calls: list[Any] = []
        self._deltasync_coord = coord

    def collective_rpc(self, method: Any, timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        self.calls.append((method, args, kwargs))
        return ["vllm"]


def test_the_hook_takes_update_weights_and_passes_the_rest_on() -> None:
    coord, engine = driven([Rank(0, ready=(3,)), Rank(1, ready=(3,))])
    core = _Core(coord)
    engine_glue._hook_weight_transfer(core)
    # init: the trainer's bucket is checked in the engine core, then the workers are called
    core.collective_rpc("init_weight_transfer_engine",
                        kwargs={"init_info": {"url": "FILE://u:p@/tmp/bucket/"}})
    core.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
    assert [c[0] for c in core.calls] == ["init_weight_transfer_engine"] * 2
    assert core.collective_rpc("start_weight_update") == ["vllm"]
    assert core.collective_rpc("update_weights",
                               kwargs={"update_info": {"step": 3, "identity": "sha256:3"}}) \
        == [None, None]
    assert core.collective_rpc("finish_weight_update") == ["vllm"]
    assert [c[0] for c in core.calls][2:] == ["start_weight_update", "finish_weight_update"]
    assert engine.version == "3"
    with pytest.raises(ValueError, match="publishes to file:///elsewhere but this server "
                                         "follows file:///tmp/bucket"):
        core.collective_rpc("init_weight_transfer_engine",
                            kwargs={"init_info": {"url": "file:///elsewhere"}})
    coord.active, coord.last_error = False, "rank 1: refused"
    with pytest.raises(RuntimeError, match="does not follow on this server: rank 1: refused"):
        core.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
    assert len(core.calls) == 4  # neither error reached the workers
    core._deltasync_coord = None
    with pytest.raises(RuntimeError, match="needs a deltasync bucket"):
        core.collective_rpc("update_weights", kwargs={"update_info": {"step": 4}})
    core.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
    assert core.calls[-1][0] == "init_weight_transfer_engine"  # the workers say what is missing


def test_A3_update_weights_out_of_vllm_protocol_order_is_refused() -> None:
    """Red team A3: ``update_weights({"step": 0})`` before ``init_weight_transfer_engine`` and
    without ``start_weight_update`` switched the engine. vLLM's protocol is init, start,
    update, finish: each call out of that order is refused, naming the order, and nothing
    reaches the workers or switches."""
    coord, engine = driven([Rank(0, ready=(3,)), Rank(1, ready=(3,))])
    core = _Core(coord)
    engine_glue._hook_weight_transfer(core)
    update = {"update_info": {"step": 3}}
    with pytest.raises(WeightUpdateRefused, match="without init_weight_transfer_engine first"):
        core.collective_rpc("update_weights", kwargs=update)
    with pytest.raises(WeightUpdateRefused, match="start_weight_update before init"):
        core.collective_rpc("start_weight_update")
    core.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
    with pytest.raises(WeightUpdateRefused, match="without start_weight_update first"):
        core.collective_rpc("update_weights", kwargs=update)
    with pytest.raises(WeightUpdateRefused, match="finish_weight_update without start"):
        core.collective_rpc("finish_weight_update")
    assert engine.version == "2" and "deltasync_apply" not in engine.calls
    assert [c[0] for c in core.calls] == ["init_weight_transfer_engine"]
    core.collective_rpc("start_weight_update")
    with pytest.raises(WeightUpdateRefused, match="while an update is active"):
        core.collective_rpc("start_weight_update")
    core.collective_rpc("update_weights", kwargs=update)
    core.collective_rpc("finish_weight_update")
    assert engine.version == "3"


def test_update_info_parsing() -> None:
    assert trainer.update_info_step({"step": 3}) == (3, None)
    assert trainer.update_info_step([{"step": 3, "identity": "i"}] * 2) == (3, "i")
    with pytest.raises(ValueError, match="takes 'step'"):
        trainer.update_info_step({"names": ["w"]})
    with pytest.raises(ValueError, match="differs between workers"):
        trainer.update_info_step([{"step": 3}, {"step": 4}])
    with pytest.raises(ValueError, match="must be"):
        trainer.update_info_step(None)


def test_another_backend_with_a_bucket_is_refused_in_one_line() -> None:
    def facts(backend: str | None) -> EngineFacts:
        return EngineFacts(data_parallel_size=1, data_parallel_index=0, is_moe=False,
                           executor_backend="mp", ranks_per_model=1,
                           weight_transfer_backend=backend,
                           additional_config={"deltasync": {"url": "file:///b"}})

    assert trainer.conflict(None) is None and trainer.conflict("deltasync") is None
    why = trainer.conflict("nccl")
    assert why is not None and "\n" not in why
    assert "'nccl'" in why and "VLLM_DELTASYNC_URL" in why and '"backend": "deltasync"' in why
    found = coordinator_config(facts("nccl"), {}, None)
    assert found is not None and found[1] == why
    found = coordinator_config(facts("deltasync"), {}, None)
    assert found is not None and found[1] is None


# ------------------------------------------------------------------------------ the receiver


def _receiver(url: str | None, extension: bool = True) -> Any:
    import torch

    from vllm_deltasync.server.vllm.weight_transfer import DeltaSyncWeightTransferEngine

    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            worker_extension_cls="vllm_deltasync.DeltaSyncExtension" if extension else ""),
        model_config=None,
        additional_config={"deltasync": {"url": url}} if url else {})
    return DeltaSyncWeightTransferEngine(SimpleNamespace(backend="deltasync"), vllm_config,
                                         torch.device("cpu"), torch.nn.Linear(2, 2))


@requires_vllm
def test_the_receiver_checks_the_bucket_and_says_why_it_was_reached(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_DELTASYNC_URL", raising=False)
    rx = _receiver("s3://rl-runs/policy/")  # a server's URL never holds credentials (issue 36)
    rx.init_transfer_engine(rx.parse_init_info({"url": "S3://key:secret@rl-runs/policy"}))
    rx.init_transfer_engine(rx.parse_init_info({}))  # no URL: nothing to check
    with pytest.raises(ValueError, match="publishes to file:///elsewhere but this server follows "
                                         "s3://rl-runs/policy/") as err:
        rx.init_transfer_engine(rx.parse_init_info({"url": "file:///elsewhere"}))
    assert "secret" not in str(err.value)
    with pytest.raises(ValueError, match="publishes to s3://other/p but") as err:
        rx.init_transfer_engine(rx.parse_init_info({"url": "s3://key:sec/ret@other/p"}))
    assert "sec" not in str(err.value) and "key" not in str(err.value)
    with pytest.raises(ValueError, match="Invalid init_info"):
        rx.parse_init_info({"bucket": "x"})
    rx.start_weight_update()
    rx.finish_weight_update()
    assert rx.supports_draft_weight_update is False
    with pytest.raises(RuntimeError, match="update_weights to step 7: .*did not take this call: "
                                           "the extension did not hook this engine core"):
        rx.update_weights({"step": 7, "identity": None})
    with pytest.raises(ValueError, match="needs the bucket this server follows"):
        _receiver(None).init_transfer_engine(_receiver(None).parse_init_info({}))
    with pytest.raises(ValueError, match="--worker-extension-cls vllm_deltasync"):
        _receiver("file:///b", extension=False).init_transfer_engine(
            _receiver("file:///b").parse_init_info({}))
    # in an engine of two ranks only the last one raises (vLLM's executor stops reading
    # answers at the first failure); the first answers None
    for rank, raises in ((0, False), (1, True), (3, True), (2, False)):  # 3, 2: DP rank 1
        rx = _receiver("file:///b")
        rx.parallel_config = SimpleNamespace(world_size=2)
        monkeypatch.setattr("vllm.distributed.parallel_state.get_world_group",
                            lambda rank=rank: SimpleNamespace(rank_in_group=rank))
        if raises:
            with pytest.raises(RuntimeError, match="did not take this call"):
                rx.update_weights({"step": 7})
        else:
            assert rx.update_weights({"step": 7}) is None


# ------------------------------------------------------------------- start and registration


class _StartingCore:
    """What ``start_coordinator`` reads and calls on an engine core (ranks answer plainly)."""

    def __init__(self, backend: str | None) -> None:
        transfer = None if backend is None else SimpleNamespace(backend=backend)
        self.vllm_config = SimpleNamespace(
            weight_transfer_config=transfer, additional_config={},
            parallel_config=SimpleNamespace(data_parallel_size=1, tensor_parallel_size=1,
                                            pipeline_parallel_size=1, data_parallel_index=0,
                                            distributed_executor_backend="mp"),
            model_config=SimpleNamespace(is_moe=False))
        self.calls: list[str] = []

    def collective_rpc(self, method: str, timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        self.calls.append(method)
        status = TargetStatus(rank=0, model="policy", last_error=args[0] if args else None)
        return [RankStatus({"policy": status}, "policy").to_wire()]

    def get_weight_version(self) -> str:
        return "0"


@requires_vllm
@pytest.mark.parametrize("backend", [None, "deltasync", "nccl"])
def test_start_is_trainer_driven_or_refused_by_backend(monkeypatch: pytest.MonkeyPatch,
                                                       backend: str | None) -> None:
    monkeypatch.setenv("VLLM_DELTASYNC_URL", "file:///tmp/bucket")
    monkeypatch.setenv("VLLM_DELTASYNC_METRICS_PORT", "0")
    core = _StartingCore(backend)
    coord = engine_glue.start_coordinator(core, in_process=True)
    try:
        assert coord.trainer_driven is (backend == "deltasync")
        if backend == "nccl":
            assert not coord.active and core.calls == ["deltasync_stop"]
            assert "--weight-transfer-config backend 'nccl'" in coord.last_error
            with pytest.raises(WeightUpdateRefused, match="does not follow on this server: "
                                                          "--weight-transfer-config"):
                coord.update_to(1)
        else:
            assert coord.active and core.calls == ["deltasync_start", "deltasync_prove",
                                                   "deltasync_follow"]
    finally:
        coord.close()


@requires_vllm
def test_registration_never_raises_and_leaves_a_taken_name(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from vllm.distributed.weight_transfer import factory

    from vllm_deltasync.server.vllm import plugin

    for registry in (factory.WeightTransferEngineFactory, factory.WeightTransferTrainerFactory):
        monkeypatch.setattr(registry, "_registry", dict(registry._registry))
        registry._registry.pop("deltasync", None)
    plugin._register_weight_transfer()
    plugin._register_weight_transfer()  # already registered: left as it is, no warning
    loaded = factory.WeightTransferEngineFactory._registry["deltasync"]()
    assert loaded.__name__ == "DeltaSyncWeightTransferEngine"
    assert factory.WeightTransferTrainerFactory._registry["deltasync"]().__name__ == \
        "DeltaSyncTrainerWeightTransferEngine"
    theirs = factory.WeightTransferEngineFactory._registry["deltasync"] = lambda: object
    plugin._register_weight_transfer()
    assert factory.WeightTransferEngineFactory._registry["deltasync"] is theirs
    assert not [r for r in caplog.records if "cannot register" in r.getMessage()]

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("registry changed")

    monkeypatch.setattr(factory.WeightTransferTrainerFactory, "register_engine", broken)
    factory.WeightTransferTrainerFactory._registry.pop("deltasync")
    plugin._register_weight_transfer()  # one warning line, no exception
    assert any("cannot register weight-transfer backend 'deltasync' in "
               "WeightTransferTrainerFactory" in r.getMessage() for r in caplog.records)
