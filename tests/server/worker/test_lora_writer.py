"""A followed LoRA adapter on one rank without vLLM (``server/worker/adapters.py``): a real PEFT
LoRA trained with AdamW and published in adapter mode by the real publisher, followed by a
real poller; the switch registers each version's full tensors (equal to what the bucket's step
rebuilds, ``read_full``) with vLLM's LoRA manager, here a stand-in that keeps what it is given
(``AdapterSlots`` is the protocol ``server/vllm/lora.py`` implements on vLLM). Put back removes
the version, retire removes older ones, and the refusals name the adapter and the fix."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.waiting import wait_until
from vllm_deltasync import BucketReader, DeltaPublisher
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.format.manifest import Manifest, fingerprint
from vllm_deltasync.server.messages import Outcome
from vllm_deltasync.server.targets import adapter_id, adapter_target
from vllm_deltasync.server.worker.adapters import AdapterRank, record_refusal, start_refusal
from vllm_deltasync.server.worker.view import WorkerView

peft = pytest.importorskip("peft")
VOCAB = 100


class Slots:
    """Stands for vLLM's LoRA manager of one worker: what it is given, by id."""

    def __init__(self, *, max_rank: int = 8, capacity: int = 4,
                 modules: frozenset[str] = frozenset({"q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"}),
                 refuse: str | None = None) -> None:
        self.max_rank, self.capacity, self._modules, self._refuse = (max_rank, capacity,
                                                                     modules, refuse)
        self.held: dict[int, dict[str, torch.Tensor]] = {}

    def modules(self) -> frozenset[str]:
        return self._modules

    def check(self, config: Mapping[str, Any]) -> str | None:
        return self._refuse

    def add(self, adapter: int, tensors: Mapping[str, torch.Tensor],
            config: Mapping[str, Any]) -> None:
        assert len(self.held) < self.capacity
        self.held[adapter] = {k: v.clone() for k, v in tensors.items()}

    def remove(self, adapter: int) -> bool:
        return self.held.pop(adapter, None) is not None

    def ids(self) -> frozenset[int]:
        return frozenset(self.held)


@dataclass
class Trained:
    url: str
    model: Any
    pub: DeltaPublisher
    opt: torch.optim.Optimizer
    step: int = -1

    def publish(self) -> int:
        """Train one AdamW step (none before step 0) and publish the next step."""
        if self.step >= 0:
            ids = torch.randint(2, VOCAB, (2, 16))
            self.model(input_ids=ids, labels=ids).loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.pub.publish(self.step, self.model)
        self.pub.flush()
        return self.step


@pytest.fixture
def trained(tmp_path: Path) -> Iterator[Trained]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64)).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16,
                                                      target_modules=["q_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    url = f"file://{tmp_path}/adapter"
    with DeltaPublisher(url, lora="adapter", anchor_every=10) as pub:
        yield Trained(url, model, pub, opt)


def _rank(trained: Trained, slots: Slots, tmp_path: Path) -> AdapterRank:
    config = SyncConfig(url=f"file://{tmp_path}/policy", lora_urls={"math": trained.url},
                        poll_interval_s=0.05, node_cache="off", staging_cpus="inherit")
    row = adapter_target("math", 2)
    source = row.source(config)
    assert source is not None
    view = WorkerView(rank=0, model=torch.nn.Linear(1, 1), model_path="", loader=None,  # type: ignore[arg-type]
                      lora=slots)
    state = AdapterRank(view, row, source, base_fingerprint=None)
    state.follow()
    return state


def _wait_ready(state: AdapterRank, step: int) -> None:
    wait_until(lambda: step in state.sync.ready_steps() or state.refused is not None, 30,
               f"step {step} staged", status=state.status)
    assert state.refused is None, state.refused


def _bucket(url: str, step: int) -> tuple[Manifest, dict[str, torch.Tensor]]:
    async def go() -> tuple[Manifest, dict[str, torch.Tensor]]:
        async with BucketReader.open(url) as reader:
            return await reader.manifest(step), await reader.read_full(step)

    return asyncio.run(go())


def test_each_switch_registers_the_steps_full_adapter(trained: Trained, tmp_path: Path) -> None:
    for _ in range(3):
        trained.publish()  # steps 0, 1, 2 staged before the first switch
    slots = Slots()
    state = _rank(trained, slots, tmp_path)
    try:
        _wait_ready(state, 2)
        assert state.switch.apply(2).outcome is Outcome.APPLIED
        manifest, want = _bucket(trained.url, 2)
        first = adapter_id("math", 2, manifest.identity)
        assert set(slots.held) == {first}  # one version for the chain 0..2
        assert all(torch.equal(slots.held[first][k], v) for k, v in want.items())
        state.switch.commit(2)
        step = trained.publish()  # a delta onto step 2
        _wait_ready(state, step)
        assert state.switch.apply(step).outcome is Outcome.APPLIED
        manifest, want = _bucket(trained.url, step)
        assert manifest.kind == "delta"
        second = adapter_id("math", step, manifest.identity)
        assert set(slots.held) == {first, second}
        assert all(torch.equal(slots.held[second][k], v) for k, v in want.items())
        state.switch.commit(step)
        versions = state.status().versions
        assert [v[:2] for v in versions] == [(2, first), (step, second)]
        # a switch taken back: the version it registered is gone, the last one is the base
        step = trained.publish()
        _wait_ready(state, step)
        assert state.switch.apply(step).outcome is Outcome.APPLIED
        assert len(slots.held) == 3
        assert state.switch.revert(step, "test").outcome is Outcome.PUT_BACK
        assert set(slots.held) == {first, second}
        assert state.sync.applied_step == 3
        # the engine core retires the oldest once no request uses it
        assert state.retire([first]) == [2]
        assert set(slots.held) == {second}
        assert [v[0] for v in state.status().versions] == [3]
    finally:
        state.close()


def test_a_version_vllm_dropped_is_forgotten(trained: Trained, tmp_path: Path) -> None:
    """vLLM's reload_weights removes every adapter: the rank stops reporting them (the engine
    core admits no request for them) and resyncs through an anchor."""
    trained.publish()
    slots = Slots()
    state = _rank(trained, slots, tmp_path)
    try:
        _wait_ready(state, 0)
        assert state.switch.apply(0).outcome is Outcome.APPLIED
        state.switch.commit(0)
        slots.held.clear()
        state.settle_writes()
        assert state.status().versions == () and state.sync.applied_step is None
        assert state.reloads == 1
    finally:
        state.close()


def test_a_refusal_found_while_staging_stops_following(trained: Trained,
                                                       tmp_path: Path) -> None:
    trained.publish()
    state = _rank(trained, Slots(max_rank=4), tmp_path)
    try:
        wait_until(lambda: state.refused is not None, 30, "the adapter refused",
                   status=state.status)
        assert "rank 8 exceeds this server's --max-lora-rank 4" in state.refused
        assert "--max-lora-rank 8" in state.refused
        status = state.status()
        assert status.refused == status.last_error and status.ready_steps == ()
        assert state.switch.apply(0).outcome is Outcome.NOTHING_WRITTEN
    finally:
        state.close()


def test_record_refusals_name_the_adapter_and_the_fix(trained: Trained) -> None:
    trained.publish()
    manifest, _ = _bucket(trained.url, 0)
    assert manifest.adapter is not None
    base = manifest.adapter.base_fingerprint
    assert record_refusal("math", manifest, Slots(), base) is None
    lines = {
        "rank": record_refusal("math", manifest, Slots(max_rank=4), base),
        "modules": record_refusal("math", manifest, Slots(modules=frozenset({"q_proj"})), base),
        "base": record_refusal("math", manifest, Slots(),
                               fingerprint([("other.weight", (2, 2), "bfloat16")])),
        "vllm": record_refusal("math", manifest, Slots(refuse="vLLM does not yet support DoRA."),
                               base),
    }
    assert "--max-lora-rank 8" in (lines["rank"] or "")
    assert "['down_proj']" in (lines["modules"] or "") and "no LoRA layer" in (lines["modules"] or "")
    assert "another base model" in (lines["base"] or "")
    assert "DoRA" in (lines["vllm"] or "")
    for line in lines.values():
        assert line is not None and line.startswith("adapter 'math'") and "\n" not in line


def test_start_refusals_name_the_option() -> None:
    assert "--enable-lora" in (start_refusal("math", None, 2, 1) or "")
    line = start_refusal("math", Slots(capacity=3), 2, 2)
    assert line is not None and "--max-cpu-loras 4" in line and "2 x 2 = 4" in line
    assert start_refusal("math", Slots(capacity=4), 2, 2) is None


def test_a_bucket_without_adapter_records_is_refused(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/plain"
    with DeltaPublisher(url) as pub:
        pub.publish(0, [("w", torch.ones(4, 4, dtype=torch.bfloat16))])
        pub.flush()
    manifest, _ = _bucket(url, 0)
    line = record_refusal("math", manifest, Slots(), None)
    assert line is not None and "not an adapter bucket" in line and "lora='adapter'" in line
