"""The prefix cache never crosses weight versions, and running requests do at a switch what
``in_flight`` says (``server/engine/kv.py``).

One engine per case, shared by the module's tests (a module-scoped fixture): TP=1 with
``in_flight=keep_kv`` (the default) and ``continue``, TP=2 with ``keep_kv``. Every engine
follows its own bucket, fed by the same trainer run (the same seed: the same checkpoints), and
switches only from a tick after every :data:`EVERY` model steps (the test failpoint
``switch_every_steps``), so a test knows a switch lands inside the batch it generates.

* Across several switches, a prompt served at the previous step is served again on the new one
  without reading any block of the previous step (``num_cached_tokens`` 0), and then again
  with hits (the cache is kept within a version); the greedy tokens, their logprobs and the
  prompt logprobs equal a fresh stock engine's on that step. A user's own ``cache_salt`` still
  isolates: ``alice`` misses the blocks of unsalted requests, then hits her own; ``bob`` misses
  hers.
* A switch inside a batch: both modes' outputs carry two spans (``weight_versions``) that say
  where it fell. ``keep_kv``: the switch record says every running request kept its KV (none
  recomputed), and the tokens after the switch differ in logprob from a recompute's. ``continue``:
  every running request was recomputed, the record counts exactly the KV tokens they had, and
  the tokens after the switch are exactly a fresh engine's continuation of the prompt and the
  tokens before it on the new step.

``drain`` at TP=2 and ``keep_kv`` / ``continue`` at TP=2 inside batches: tests/engine/test_continuous.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model
from tests.helpers.engine_hooks import switch_every_steps_env
from tests.helpers.engines import (
    FreshOutputs,
    Trainer,
    close_llm,
    engine_env,
    engine_status,
    generate,
    long_prompts,
    make_llm,
    requires_vllm,
    token_logprobs,
    wait_applied,
    wait_ready,
)
from vllm_deltasync import DeltaPublisher

EVERY = 6
"""Model steps between the ticks that may switch."""
SEED = 7
SALT_SWITCHES = 3


@dataclass
class Served:
    """One engine following its own bucket, and the trainer run feeding it."""

    tp: int
    in_flight: str
    llm: Any
    trainer: Trainer
    publisher: DeltaPublisher
    tmp: Path
    step: int = 0

    def advance(self) -> Path:
        """Publish the next step and switch to it inside a batch; its checkpoint."""
        self.step += 1
        self.trainer.step()
        self.publisher.publish(self.step, self.trainer.named_tensors())
        self.publisher.flush()
        self.switch_inside_a_batch()
        return self.trainer.save(self.tmp / f"ckpt-{self.step}")

    def switch_inside_a_batch(self) -> None:
        """The staged step :attr:`step` is switched to by a batch (switches start only from
        the ticks after model steps)."""
        from vllm import SamplingParams

        wait_ready(self.llm, self.step)
        self.llm.generate(["warm up the switch"], SamplingParams(
            temperature=0.0, max_tokens=2 * EVERY, ignore_eos=True), use_tqdm=False)
        wait_applied(self.llm, self.step)


CASES = [pytest.param((1, "keep_kv"), id="tp1-keep_kv"),
         pytest.param((1, "continue"), id="tp1-continue"),
         pytest.param((2, "keep_kv"), id="tp2-keep_kv")]


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tp, in_flight = request.param
    tmp = tmp_path_factory.mktemp(f"kv-{tp}-{in_flight}")
    model_dir = build_model(tmp / "model", "llama", seed=SEED)
    trainer = Trainer(model_dir, lr=1e-3, seed=SEED)
    url = f"file://{tmp}/bucket"
    with contextlib.ExitStack() as stack:
        pub = stack.enter_context(DeltaPublisher(url, anchor_every=4))
        stack.enter_context(engine_env(tmp, tp, switch_every_steps_env(EVERY), url=url,
                                       poll_interval_s=0.05, metrics_port=0,
                                       in_flight=in_flight))
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = make_llm(model_dir, tp, extension=True)
        stack.callback(close_llm, llm)
        served = Served(tp, in_flight, llm, trainer, pub, tmp)
        served.switch_inside_a_batch()
        yield served


def _salted(llm: Any, prompts: list[str], salt: str) -> list[int]:
    """``num_cached_tokens`` of each prompt served with ``cache_salt=salt``."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt": p, "cache_salt": salt} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    return [o.num_cached_tokens for o in outs]


@requires_vllm
@pytest.mark.engine
@pytest.mark.parametrize("served", CASES, indirect=True)
def test_no_request_reads_a_block_of_other_weights(served: Served,
                                                   fresh_outputs: FreshOutputs) -> None:
    llm = served.llm
    prompts = long_prompts(3, words=300, seed=SEED)  # two full 128-token blocks each
    generate(llm, prompts)  # the current step's blocks, before the first switch below
    _salted(llm, prompts, "alice")
    for _ in range(SALT_SWITCHES):
        ckpt = served.advance()
        first, again = generate(llm, prompts), generate(llm, prompts)
        step = served.step
        assert [o["cached"] for o in first] == [0] * len(prompts), (
            f"step {step}: a prompt served at the previous step read its blocks")
        assert all(o["cached"] >= 256 for o in again), f"step {step}: no hit within a version"
        for name in ("tokens", "logprobs", "prompt_logprobs"):
            assert [o[name] for o in again] == [o[name] for o in first], (step, name)
        assert all({s.version for s in o["weight_versions"]} == {str(step)} for o in first)
        assert _salted(llm, prompts, "alice") == [0] * len(prompts), (
            f"step {step}: alice's request read another salt's or another step's blocks")
        assert min(_salted(llm, prompts, "alice")) >= 256, "alice does not hit her own blocks"
        assert _salted(llm, prompts, "bob") == [0] * len(prompts), "bob read alice's blocks"
    (want,) = fresh_outputs(served.tp, prompts, [ckpt])
    for i, (got, ref) in enumerate(zip(first, want, strict=True)):
        for name in ("tokens", "logprobs", "prompt_logprobs"):
            assert got[name] == ref[name], f"prompt {i}: {name} differ from a fresh engine's"
    status = engine_status(llm)
    assert status["failed_ticks"] == 0 and status["last_error"] is None


@requires_vllm
@pytest.mark.engine
@pytest.mark.parametrize("served", CASES[:2], indirect=True)
def test_running_requests_at_a_switch_do_what_in_flight_says(
        served: Served, fresh_outputs: FreshOutputs) -> None:
    from vllm import SamplingParams

    llm = served.llm
    prompts = [[(37 * i + 11 * j) % 480 + 10 for j in range(40 + 8 * i)] for i in range(4)]
    served.step += 1
    served.trainer.step()
    served.publisher.publish(served.step, served.trainer.named_tensors())
    served.publisher.flush()
    wait_ready(llm, served.step)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=24, logprobs=0,
                                       ignore_eos=True), use_tqdm=False)
    wait_applied(llm, served.step)
    ckpt = served.trainer.save(served.tmp / f"ckpt-{served.step}")
    record = engine_status(llm)["switches"][-1]
    assert record["step"] == served.step and record["in_flight"] == served.in_flight

    crossed = []  # (prompt, output, index of the first token on the new step)
    for p, o in zip(prompts, outs, strict=True):
        spans = o.outputs[0].weight_versions
        versions = [s.version for s in spans]
        if versions == [str(served.step)]:
            continue  # admitted after the switch (vLLM may add a batch over two steps)
        assert versions == [str(served.step - 1), str(served.step)], spans
        assert 0 < spans[1].start <= 24 - 12, spans  # inside, 12 tokens after it
        crossed.append((p, o, spans[1].start))
    assert crossed, ("the switch fell before the batch; the last model steps (step, version "
                     "before, after, tokens):", llm.collective_rpc("deltasync_trace")[0][-30:])
    continued = [{"prompt_token_ids": p + list(o.outputs[0].token_ids[:c])} for p, o, c in crossed]
    (fresh,) = fresh_outputs(1, continued, [ckpt])  # a recompute on the new step, token by token
    after = [(list(o.outputs[0].token_ids[c:c + 12]), token_logprobs(o.outputs[0])[c:c + 12])
             for _, o, c in crossed]
    if served.in_flight == "continue":
        assert record["recomputed"] == len(crossed) and record["kept"] == 0
        assert record["recompute_tokens"] == sum(len(p) + c - 1 for p, _, c in crossed)
        assert after == [(f["tokens"], f["logprobs"]) for f in fresh], (
            "continue: the tokens after the switch are not the new step's on that prefix")
    else:
        assert record["kept"] == len(crossed) and record["recomputed"] == 0
        assert record["recompute_tokens"] == 0
        assert any(a[1][0] != f["logprobs"][0] for a, f in zip(after, fresh, strict=True)), (
            "keep_kv: the first token after the switch is exactly a recompute's")
