"""vLLM's weight-transfer API with backend ``deltasync``, end to end on the CPU build.

A real engine is started the way a user of TRL / SkyRL / prime-rl would: the extension, the
bucket URL, and ``weight_transfer_config={"backend": "deltasync"}``. The trainer side is built by
vLLM's own ``WeightTransferTrainerFactory.trainer_init`` with a ``ModuleSource`` over a real
model trained with AdamW, and drives the engine through vLLM's own offline client calls
(``LLM.init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``; a four-method adapter, as ``HTTPVLLMWeightSyncClient`` is for the
dev-mode HTTP routes). One engine per TP size, several updates each (an anchor, a delta, an
anchor again). After each update:

* vLLM's weight version is the step, and every rank's live weights equal the trainer's
  checkpoint of that step (sha256 per tensor, per rank for its shard);
* greedy tokens and prompt logprobs equal those of a fresh engine of the same TP started from
  that checkpoint: a stock one (tests/engine/fresh_engine.py) for the steps the trainer
  changed; for step 0, whose weights are the checkpoint the engine under test was started
  from, the engine's own outputs before its first update (it is that fresh engine; each
  stock engine at TP=2 costs ~25 s of the suite).

The engine's coordinator runs trainer-driven: its pollers stage the steps, but it switches only
on ``update_weights`` (the switches it lists are exactly the steps the trainer sent). At TP=1
also: a step published and staged is not switched to by the ticks; the same step again is a
no-op; an older step is refused with a clear error and the session can be closed and reused.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model
from tests.helpers.engines import (
    EXTENSION,
    FreshOutputs,
    Trainer,
    close_llm,
    digests_equal_checkpoint,
    engine_env,
    engine_status,
    generate,
    long_prompts,
    requires_vllm,
    wait_ready,
)

UPDATES = 3
"""Steps 0 (anchor), 1 (delta), 2 (anchor again: anchor_every=2); at TP=1 a fourth step, a
delta on that anchor, is switched to by hand (``_checks_at_tp1``)."""


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the offline ``LLM``'s own methods."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)


def _llm(model_dir: Path, tp: int) -> Any:
    from vllm import LLM

    return LLM(model=str(model_dir), tensor_parallel_size=tp, enforce_eager=True,
               max_model_len=1024, dtype="bfloat16", seed=0, enable_prefix_caching=True,
               max_num_seqs=8, worker_extension_cls=EXTENSION,
               weight_transfer_config={"backend": "deltasync"})


def _checks_at_tp1(llm: Any, engine: Any, trainer: Trainer, applied: int) -> int:
    """A step published and staged is not switched to by the ticks; the same step is a no-op;
    an older one is refused. Returns the step now applied."""
    staged = engine.publisher.next_step
    trainer.step()
    engine.publisher.publish(staged, trainer.named_tensors())
    engine.publisher.flush()
    wait_ready(llm, staged)
    time.sleep(1.0)  # five ticks at poll_interval_s=0.2
    assert {s["applied_step"] for s in llm.collective_rpc("deltasync_status")} == {applied}
    assert llm.get_weight_version() == str(applied)

    llm.start_weight_update()
    llm.update_weights({"update_info": {"step": staged, "identity": engine.identity(staged)}})
    llm.finish_weight_update(weight_version=str(staged))
    assert llm.get_weight_version() == str(staged)
    llm.start_weight_update()
    llm.update_weights({"update_info": {"step": staged}})  # the same step: nothing to do
    with pytest.raises(Exception, match=f"step {applied} refused: this server applied step "
                                        f"{staged}, which is newer"):
        llm.update_weights({"update_info": {"step": applied}})
    llm.finish_weight_update()
    assert {s["applied_step"] for s in llm.collective_rpc("deltasync_status")} == {staged}
    return staged


@requires_vllm
@pytest.mark.engine
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_trainer_drives_the_engine_through_vllms_weight_transfer_api(
    tmp_path: Path, fresh_outputs: FreshOutputs, tp: int
) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_deltasync.trainer.weight_transfer import DeltaSyncTrainerInitInfo

    seed = 40 + tp
    model_dir = build_model(tmp_path / "model", "llama", num_kv_heads=2, seed=seed)
    trainer = Trainer(model_dir, lr=1e-5, seed=seed)
    url = f"file://{tmp_path}/bucket"
    prompts = long_prompts(2, seed=seed)
    checkpoints: dict[int, Path] = {}
    outputs: dict[int, list[dict[str, Any]]] = {}
    extra: list[int] = []
    with engine_env(tmp_path, tp, url=url, poll_interval_s=0.2, metrics_port=0):
        llm = _llm(model_dir, tp)
        engine = None
        try:
            started = generate(llm, prompts)  # a fresh engine on the checkpoint, i.e. step 0
            engine = WeightTransferTrainerFactory.trainer_init(
                DeltaSyncTrainerInitInfo(url=url, rank=0,
                                         publisher_options={"anchor_every": 2}),
                client=LLMClient(llm), source=ModuleSource(trainer.model))
            for i in range(UPDATES):
                if i:
                    trainer.step()
                step = engine.send_weights()
                assert step == i
                assert llm.get_weight_version() == str(step)
                checkpoints[step] = trainer.save(tmp_path / f"ckpt-{step}")
                assert digests_equal_checkpoint(llm, checkpoints[step]), f"step {step}"
                outputs[step] = generate(llm, prompts)
            if tp == 1:
                extra.append(_checks_at_tp1(llm, engine, trainer, UPDATES - 1))
            status = engine_status(llm)
        finally:
            if engine is not None:
                engine.shutdown()
            close_llm(llm)

    assert [s["step"] for s in status["switches"]] == [*range(UPDATES), *extra]
    assert status["last_error"] is None and status["held"] is None
    assert all(o["weight_versions"][-1].version == str(UPDATES - 1)
               for o in outputs[UPDATES - 1])
    stock = fresh_outputs(tp, prompts, [checkpoints[s] for s in range(1, UPDATES)])
    references = [[{k: v for k, v in o.items() if k != "weight_versions"} for o in started],
                  *stock]
    for step, want in zip(range(UPDATES), references, strict=True):
        for i, (got, ref) in enumerate(zip(outputs[step], want, strict=True)):
            assert got["tokens"] == ref["tokens"], f"step {step} prompt {i}: greedy tokens differ"
            assert got["prompt_logprobs"] == ref["prompt_logprobs"], (
                f"step {step} prompt {i}: prompt logprobs differ from a fresh engine's")
