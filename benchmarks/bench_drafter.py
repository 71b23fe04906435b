"""Drafter benchmark: speculative decoding with the drafter following its bucket vs frozen.

Two engines, alive together (one child process each), serve the same policy with speculative decoding
(``method="draft_model"``, ``NUM_SPEC`` tokens per round). The draft starts as a copy of the
policy (same architecture, same weights: what a draft distilled to the policy, or a copy of
its MTP head, is at step 0). A trainer takes real AdamW steps on the policy at a learning rate
high enough that greedy tokens drift within tens of steps (``LR``), and publishes each step to
the policy bucket, and the same tensors to the drafter bucket (the draft kept a copy).

* **following**: the engine follows both buckets (``drafter_url``): policy and draft at step k;
* **frozen**: the engine follows the policy bucket only: its draft stays the step-0 copy.

After step 0, step 1 and every second step (``EVERY``; both engines follow every step), once
both engines applied it, each decodes the same batch (``BATCH`` prompts, ``TOKENS`` greedy tokens,
``ignore_eos``), the engine measured first alternating from one measured step to the next. Per step and engine: the acceptance rate (vLLM's own counters,
``vllm:spec_decode_num_accepted_tokens`` / ``vllm:spec_decode_num_draft_tokens``, the
increase over that batch), the mean tokens per verification round, and decode throughput
(generated tokens / wall seconds). The greedy tokens of the two engines are compared too:
speculative decoding must not change them, whatever the draft.

On this CPU build the draft costs what the policy costs (a copy), so speculation itself does
not speed decoding up here; what the table shows is the difference the drafter's following
makes at equal cost: a draft that follows keeps its acceptance, a frozen one loses it as the
policy moves, and every rejected draft token is a forward pass spent for nothing.

    .venv/bin/python -m benchmarks.bench_drafter [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_apply import engine_env
from examples.toymodel import build_model, load_hf_model
from vllm_deltasync import DeltaPublisher

MODEL: dict[str, Any] = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
                         "intermediate_size": 688, "vocab_size": 2000}
LR = 1e-4
STEPS = 16
QUICK_STEPS = 4
EVERY = 2
"""Both engines decode (are measured) after step 0, step 1 and every ``EVERY``-th step; they
follow every step."""
NUM_SPEC = 3
BATCH = 8
TOKENS = 48
PROMPTS = [f"{w} river mountain city garden {i}" for i, w in
           enumerate(("the", "a", "one", "every", "some", "this", "that", "no"))]


class _Trainer:
    """Real AdamW steps on the policy (random tokens, LM loss) in bf16."""

    def __init__(self, model_dir: Path, lr: float) -> None:
        self.model = load_hf_model(model_dir)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(0)
        self.vocab: int = self.model.config.vocab_size  # type: ignore[union-attr,assignment]

    def step(self) -> None:
        ids = torch.randint(2, self.vocab, (4, 64), generator=self.gen)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]


def _llm(policy: Path, draft: Path) -> Any:
    from vllm import LLM

    return LLM(model=str(policy), enforce_eager=True, max_model_len=512, dtype="bfloat16",
               seed=0, max_num_seqs=BATCH, disable_log_stats=False,
               worker_extension_cls="vllm_deltasync.DeltaSyncExtension",
               speculative_config={"method": "draft_model", "model": str(draft),
                                   "num_speculative_tokens": NUM_SPEC})


def _serve(conn: Any, policy: str, draft: str, env: dict[str, str]) -> None:
    """A child process with one engine (vLLM's metrics registry is per process: two engines
    in one process would share, and unregister, each other's counters). Answers the parent's
    ``("decode", step)`` with that step's measurements, once the step is applied."""
    os.environ.update(env)
    llm = _llm(Path(policy), Path(draft))
    try:
        llm.generate(PROMPTS[:2], use_tqdm=False)  # warm-up (first-call costs)
        conn.send("ready")
        while (msg := conn.recv()) is not None:
            _, step = msg
            _wait(llm, step, drafter="VLLM_DELTASYNC_DRAFTER_URL" in env)
            conn.send(_decode(llm))
    finally:
        llm.llm_engine.engine_core.shutdown()


class _Engine:
    """The parent's handle on one engine's child process."""

    def __init__(self, policy: Path, draft: Path, url: str, drafter_url: str | None) -> None:
        import multiprocessing

        env = {"VLLM_DELTASYNC_URL": url, "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.1",
               "VLLM_DELTASYNC_METRICS_PORT": "0"}
        if drafter_url:
            env["VLLM_DELTASYNC_DRAFTER_URL"] = drafter_url
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, str(policy), str(draft), env),
                                daemon=False)
        self.proc.start()

    def ready(self) -> None:
        if not self.conn.poll(300) or self.conn.recv() != "ready":
            raise TimeoutError("the engine did not start within 300 s")

    def decode(self, step: int) -> dict[str, Any]:
        self.conn.send(("decode", step))
        if not self.conn.poll(300):
            raise TimeoutError(f"step {step}: no answer within 300 s")
        return self.conn.recv()  # type: ignore[no-any-return]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


def _counters(llm: Any) -> tuple[float, float, float]:
    """vLLM's (drafts, draft tokens, accepted tokens) counters so far."""
    got = {"vllm:spec_decode_num_drafts": 0.0, "vllm:spec_decode_num_draft_tokens": 0.0,
           "vllm:spec_decode_num_accepted_tokens": 0.0}
    for m in llm.get_metrics():
        if m.name in got and hasattr(m, "value"):
            got[m.name] += float(m.value)
    return (got["vllm:spec_decode_num_drafts"], got["vllm:spec_decode_num_draft_tokens"],
            got["vllm:spec_decode_num_accepted_tokens"])


def _wait(llm: Any, step: int, drafter: bool, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = llm.collective_rpc("deltasync_status")
        done = all(s.get("applied_step") == step for s in statuses) and (
            not drafter or all((s.get("drafter") or {}).get("applied_step") == step
                               for s in statuses))
        if done:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} not applied in {timeout_s}s: {statuses}")
        time.sleep(0.05)


def _decode(llm: Any) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    before = _counters(llm)
    started = time.perf_counter()
    outs = llm.generate(PROMPTS[:BATCH], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    drafts, drafted, accepted = (a - b for a, b in zip(_counters(llm), before, strict=True))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"acceptance": accepted / drafted if drafted else float("nan"),
            "per_round": 1 + accepted / drafts if drafts else float("nan"),
            "tok_s": sum(len(t) for t in tokens) / seconds, "tokens": tokens}


def _measure(tmp: Path, steps: int) -> list[dict[str, Any]]:
    policy_dir = build_model(tmp / "policy", "llama", **MODEL)
    draft_dir = tmp / "draft"
    import shutil

    shutil.copytree(policy_dir, draft_dir)  # the draft starts as a copy of the policy
    trainer = _Trainer(policy_dir, LR)
    p_url, d_url = f"file://{tmp}/policy-bucket", f"file://{tmp}/draft-bucket"
    rows: list[dict[str, Any]] = []
    with DeltaPublisher(p_url, anchor_every=1000) as ppub, \
            DeltaPublisher(d_url, anchor_every=1000) as dpub:
        ppub.publish(0, trainer.named_tensors())
        dpub.publish(0, trainer.named_tensors())
        ppub.flush()
        dpub.flush()
        engines = {"following": _Engine(policy_dir, draft_dir, p_url, d_url),
                   "frozen": _Engine(policy_dir, draft_dir, p_url, None)}
        try:
            for engine in engines.values():
                engine.ready()
            for step in range(steps + 1):
                if step:
                    trainer.step()
                    ppub.publish(step, trainer.named_tensors())
                    dpub.publish(step, trainer.named_tensors())
                    ppub.flush()
                    dpub.flush()
                if step > 1 and step % EVERY:
                    continue
                order = list(engines) if len(rows) % 2 == 0 else list(reversed(engines))
                got = {name: engines[name].decode(step) for name in order}
                rows.append({"step": step, **{f"{n}_{k}": v for n, r in got.items()
                                              for k, v in r.items() if k != "tokens"},
                             "same_tokens": got["following"]["tokens"] == got["frozen"]["tokens"]})
        finally:
            for engine in engines.values():
                engine.close()
    return rows


def run(quick: bool = False) -> str:
    """Markdown section: one row per step, both engines side by side."""
    steps = QUICK_STEPS if quick else STEPS
    with tempfile.TemporaryDirectory(prefix="bench-drafter-") as tmp_name:
        tmp = Path(tmp_name)
        engine_env(tmp)
        rows = _measure(tmp, steps)
    lines = [
        "## drafter: speculative decoding with the drafter following vs frozen (TP=1)",
        "",
        f"Policy: Llama {MODEL['hidden_size']} hidden x {MODEL['num_layers']} layers, trained "
        f"with AdamW at lr {LR:g} (random tokens); draft: a copy of the policy at step 0, "
        f"{NUM_SPEC} speculative tokens per round; {BATCH} prompts x {TOKENS} greedy tokens "
        f"per measured step and engine: steps 0, 1 and every {EVERY}th (both engines follow every "
        "step). Acceptance = vLLM's accepted / draft tokens over the batch; "
        "tokens per round = 1 + accepted / drafts. Both engines alive, measured one after the "
        "other (order alternating per step).",
        "",
        "| step | following: acceptance | frozen: acceptance | following: tokens/round "
        "| frozen: tokens/round | following: tok/s | frozen: tok/s | frozen / following tok/s "
        "| greedy tokens equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['following_acceptance']:.3f} | {r['frozen_acceptance']:.3f} "
            f"| {r['following_per_round']:.2f} | {r['frozen_per_round']:.2f} "
            f"| {r['following_tok_s']:.0f} | {r['frozen_tok_s']:.0f} "
            f"| {r['frozen_tok_s'] / r['following_tok_s']:.2f} | {r['same_tokens']} |")
    late = rows[len(rows) // 2:]
    lines += [
        "",
        f"Second half of the run (steps {late[0]['step']}-{late[-1]['step']}), medians: "
        f"acceptance {statistics.median(r['following_acceptance'] for r in late):.3f} following "
        f"vs {statistics.median(r['frozen_acceptance'] for r in late):.3f} frozen; decode "
        f"{statistics.median(r['following_tok_s'] for r in late):.0f} vs "
        f"{statistics.median(r['frozen_tok_s'] for r in late):.0f} tokens/s.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))
