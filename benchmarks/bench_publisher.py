"""Publisher benchmark: real AdamW steps on bf16 weights at lr 3e-6, published to a file:// bucket.

For the example's Llama-shaped model (and, without ``--quick``, a larger one) it reports the
sparsity of each delta, bytes per step against a full bf16 checkpoint, bytes per changed
element, and the publisher's cost per step beside the optimizer step's:

* ``publish()`` is what the training loop pays (host bf16 snapshot + bit comparison);
* ``upload`` runs on the publisher's background thread (encode, sha256, write, manifest).

    .venv/bin/python benchmarks/bench_publisher.py [--quick]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from examples.toymodel import build_model, load_hf_model
from vllm_deltasync import DeltaPublisher


@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    layers: int
    vocab: int
    steps: int


@dataclass
class Result:
    case: Case
    params: int
    sparsity: float
    delta_bytes: float
    changed: float
    full_bytes: int
    anchor_bytes: int
    fwd_bwd_ms: float
    opt_ms: float
    publish_ms: float
    upload_ms: float
    anchor_upload_ms: float


def _measure(case: Case, workdir: Path) -> Result:
    model_dir = build_model(workdir / case.name, "llama", hidden_size=case.hidden, num_layers=case.layers,
                            num_heads=4, num_kv_heads=2, intermediate_size=case.hidden * 8 // 3 // 8 * 8,
                            vocab_size=case.vocab, seed=0)
    model = load_hf_model(model_dir, dtype=torch.bfloat16)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-6, weight_decay=0.0)
    torch.manual_seed(0)
    fwd_bwd, opt, manifests = [], [], {}
    url = f"file://{workdir / (case.name + '-bucket')}"
    with DeltaPublisher(url, anchor_every=10, on_commit=lambda m: manifests.__setitem__(m.step, m)) as pub:
        for step in range(case.steps):
            tokens = torch.randint(0, case.vocab, (4, 64))
            started = time.perf_counter()
            model(input_ids=tokens, labels=tokens).loss.backward()
            middle = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            fwd_bwd.append(middle - started)
            opt.append(time.perf_counter() - middle)
            pub.publish(step, model.named_parameters())
        pub.flush()
        per_step = list(pub.stats.per_step)
    deltas = [m for m in manifests.values() if m.kind == "delta"]
    anchor_steps = {m.step for m in manifests.values() if m.kind == "anchor"}
    params = sum(p.numel() for p in model.parameters())
    return Result(
        case=case, params=params,
        sparsity=statistics.mean(m.sparsity for m in deltas),
        delta_bytes=statistics.mean(m.totals.bytes for m in deltas),
        changed=statistics.mean(m.totals.changed for m in deltas),
        full_bytes=params * 2,
        anchor_bytes=manifests[0].totals.bytes,
        fwd_bwd_ms=statistics.median(fwd_bwd) * 1e3,
        opt_ms=statistics.median(opt) * 1e3,
        publish_ms=statistics.median(d for s, d, _ in per_step if s not in anchor_steps) * 1e3,
        upload_ms=statistics.median(u for s, _, u in per_step if s not in anchor_steps) * 1e3,
        anchor_upload_ms=statistics.median(u for s, _, u in per_step if s in anchor_steps) * 1e3,
    )


def _table(results: list[Result]) -> str:
    head = ("| model | params | delta steps | sparsity | delta bytes/step | full bf16 | delta/full "
            "| bytes/changed elem | anchor bytes | fwd+bwd ms | optimizer.step ms | publish() ms "
            "| upload ms (delta) | upload ms (anchor) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(
            f"| {r.case.name} | {r.params / 1e6:.2f}M | {r.case.steps - (r.case.steps + 9) // 10} "
            f"| {r.sparsity * 100:.3f}% | {r.delta_bytes / 2**10:.1f} KiB | {r.full_bytes / 2**20:.2f} MiB "
            f"| {r.delta_bytes / r.full_bytes * 100:.2f}% | {r.delta_bytes / r.changed:.2f} "
            f"| {r.anchor_bytes / 2**20:.2f} MiB | {r.fwd_bwd_ms:.1f} | {r.opt_ms:.1f} | {r.publish_ms:.1f} "
            f"| {r.upload_ms:.1f} | {r.anchor_upload_ms:.1f} |"
        )
    return "\n".join(lines)


DEFAULT_CODEC = inspect.signature(DeltaPublisher).parameters["codec"].default


def run(quick: bool = False) -> str:
    """Run the benchmark; returns a Markdown table (medians per step; sparsity, bytes: means)."""
    cases = [Case("example (llama h256 L4)", 256, 4, 2000, 6 if quick else 21)]
    if not quick:
        cases.append(Case("llama h512 L8", 512, 8, 8000, 11))
    with tempfile.TemporaryDirectory(prefix="bench-publisher-") as tmp:
        results = [_measure(case, Path(tmp)) for case in cases]
    note = ("AdamW (torch, bf16 weights, lr 3e-6), batch 4 x 64 tokens, anchor every 10 steps, "
            f"{DEFAULT_CODEC} (the publisher's default), file:// bucket; "
            f"{torch.get_num_threads()} torch threads.")
    return f"### Publisher\n\n{note}\n\n{_table(results)}\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Publisher benchmark")
    parser.add_argument("--quick", action="store_true", help="the example model only, 6 steps")
    print(run(quick=parser.parse_args().quick))
