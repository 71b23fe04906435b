"""Publisher benchmark: real AdamW steps on bf16 weights at lr 3e-6, published to a file:// bucket.

For the example's Llama-shaped model (and, without ``--quick``, a larger one) it reports the
sparsity of each delta, bytes per step against a full bf16 checkpoint, bytes per changed
element, and the publisher's cost per step beside the optimizer step's:

* ``publish()`` is what the training loop pays (the diff against the one bf16 copy of the
  last step, updated in place; trainer/diff.py);
* ``upload`` runs on the publisher's background thread (encode, sha256, write, manifest).

A second table sets ``publish()`` and a whole step (``publish`` until its manifest is
committed) beside the snapshot floor: one bf16 copy of the local parameters to host memory,
what the publisher took every step before 0.5 and the least any diff against a kept copy that
first snapshots the weights pays; measured in the same steps (interleaved). On a CUDA device
(``--device cuda``, the GPU script) the same row runs with the parameters on the device.

    .venv/bin/python benchmarks/bench_publisher.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from examples.toymodel import build_model, load_hf_model
from vllm_deltasync import DeltaPublisher, PublisherOptions


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


@dataclass
class FloorResult:
    case: Case
    device: str
    params: int
    changed: float
    floor_ms: float
    publish_ms: float
    whole_ms: float
    legacy_ms: float
    lr: float


def _legacy_diff(params: list[torch.Tensor], last: list[np.ndarray] | None) -> list[np.ndarray]:
    """What publish() did before 0.5, for the same weights: a host bf16 snapshot of every
    parameter, then a comparison with the previous snapshot and a gather of the changes."""
    snap = []
    for i, p in enumerate(params):
        src = p.detach()
        if src.device.type == "cpu" and src.dtype == torch.bfloat16:
            bits = src.contiguous().view(torch.int16).numpy().reshape(-1).copy()
        else:
            bits = src.to(torch.bfloat16).to("cpu").contiguous().view(torch.int16).numpy().reshape(-1)
        if last is not None:
            where = np.flatnonzero(bits != last[i])
            bits[where], last[i][where]  # the gathers of the new and old values
        snap.append(bits)
    return snap


FLOOR_LR = 1.5e-6
"""The snapshot-floor row's learning rate: ~1% of the bf16 weights change per step (issue 27's
condition; 3e-6 changes ~1.6% on this model)."""


class _Floor:
    """One bf16 copy of the parameters into host buffers allocated (and touched) once: the
    strict floor, a plain memory copy without the page faults of fresh allocations (which
    the pre-0.5 snapshot paid, and the 'before 0.5' column still does)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.dst = [torch.empty(p.numel(), dtype=torch.bfloat16, pin_memory=p.device.type == "cuda")
                    for p in params]
        self(params)

    def __call__(self, params: list[torch.Tensor]) -> float:
        """Seconds for the copy."""
        if params[0].device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for p, d in zip(params, self.dst, strict=True):
            src = p.detach()
            if src.device.type == "cpu" and src.dtype == torch.bfloat16:
                np.copyto(d.view(torch.int16).numpy(), src.contiguous().view(torch.int16).numpy().reshape(-1))
            else:
                d.copy_(src.reshape(-1))
        if params[0].device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started


FLOOR_RUNS = 3
"""Runs of the trained model's floor row: its 8 delta steps take ~20 ms each, and one run's
ratio moved by ~0.3 from run to run on this shared machine."""


def _span(values: Iterable[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[0], ordered[-1]


def _measure_floor(case: Case, workdir: Path, device: str) -> FloorResult:
    """publish() and publish -> committed beside the snapshot floor, every delta step."""
    model_dir = build_model(workdir / (case.name + "-floor"), "llama", hidden_size=case.hidden,
                            num_layers=case.layers, num_heads=4, num_kv_heads=2,
                            intermediate_size=case.hidden * 8 // 3 // 8 * 8,
                            vocab_size=case.vocab, seed=0)
    model = load_hf_model(model_dir, dtype=torch.bfloat16).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=FLOOR_LR, weight_decay=0.0)
    torch.manual_seed(0)
    params = [p for p in model.parameters()]
    floor, publish, whole, changed, legacy = [], [], [], [], []
    last = _legacy_diff(params, None)
    snapshot_floor = _Floor(params)
    manifests: dict[int, object] = {}
    url = f"file://{workdir / (case.name + '-floor-bucket')}"
    with DeltaPublisher(url, anchor_every=1000, on_commit=lambda m: manifests.__setitem__(m.step, m)) as pub:
        for step in range(case.steps):
            tokens = torch.randint(0, case.vocab, (4, 64), device=device)
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            floor.append(snapshot_floor(params))
            started = time.perf_counter()
            last = _legacy_diff(params, last)
            legacy.append(time.perf_counter() - started)
            started = time.perf_counter()
            pub.publish(step, model.named_parameters())
            middle = time.perf_counter()
            pub.flush()
            done = time.perf_counter()
            if step:  # step 0 is the anchor
                publish.append(middle - started)
                whole.append(done - started)
                changed.append(manifests[step].totals.changed)  # type: ignore[attr-defined]
    return FloorResult(case, device, sum(p.numel() for p in params), statistics.mean(changed),
                       statistics.median(floor) * 1e3, statistics.median(publish) * 1e3,
                       statistics.median(whole) * 1e3, statistics.median(legacy[1:]) * 1e3, FLOOR_LR)


def _measure_floor_synthetic(workdir: Path, device: str, steps: int, quick: bool) -> FloorResult:
    """The same row on tensors of a 7B model's size (one Llama-2-7B decoder layer, 202M
    parameters) with synthetic steps: 1% of each tensor's elements moved by 1-3 bf16 ulps at
    random positions (drawn before the timings), as RL steps move them (REFERENCE §1)."""
    h, inter = (1024, 2752) if quick else (4096, 11008)
    gen = torch.Generator().manual_seed(0)
    shapes = {"q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h), "gate": (inter, h),
              "up": (inter, h), "down": (h, inter)}
    tensors = {f"layer.{k}.weight": torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)
               for k, shape in shapes.items()}
    params = list(tensors.values())
    n = sum(t.numel() for t in params)
    floor, publish, whole, changed, legacy = [], [], [], [], []
    last = _legacy_diff(params, None)
    snapshot_floor = _Floor(params)
    manifests: dict[int, object] = {}
    url = f"file://{workdir / 'synthetic-floor-bucket'}"
    with DeltaPublisher(url, anchor_every=1000, on_commit=lambda m: manifests.__setitem__(m.step, m)) as pub:
        pub.publish(0, tensors)
        pub.flush()
        for step in range(1, steps + 1):
            for t in params:
                flat = t.view(-1).view(torch.int16)
                pick = torch.randint(0, flat.numel(), (flat.numel() // 100,), generator=gen).to(device)
                flat[pick] += torch.randint(1, 4, (pick.numel(),), generator=gen, dtype=torch.int16).to(device)
            if device == "cuda":
                torch.cuda.synchronize()
            floor.append(snapshot_floor(params))
            started = time.perf_counter()
            last = _legacy_diff(params, last)
            legacy.append(time.perf_counter() - started)
            started = time.perf_counter()
            pub.publish(step, tensors)
            middle = time.perf_counter()
            pub.flush()
            publish.append(middle - started)
            whole.append(time.perf_counter() - started)
            changed.append(manifests[step].totals.changed)  # type: ignore[attr-defined]
    name = f"7B layer shapes ({'quarter width, ' if quick else ''}synthetic 1% steps)"
    return FloorResult(Case(name, h, 1, 0, steps), device, n, statistics.mean(changed),
                       statistics.median(floor) * 1e3, statistics.median(publish) * 1e3,
                       statistics.median(whole) * 1e3, statistics.median(legacy) * 1e3, 0.0)


def _floor_table(results: list[FloorResult]) -> str:
    head = ("| model | device | params | lr | changed / step | snapshot floor ms (one bf16 copy) "
            "| publish() ms | publish() / floor | publish -> committed ms | committed / floor "
            "| publish() before 0.5 ms (snapshot + compare) | before / floor |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(
            f"| {r.case.name} | {r.device} | {r.params / 1e6:.2f}M | {f'{r.lr:g}' if r.lr else '-'} "
            f"| {r.changed / r.params * 100:.2f}% "
            f"| {r.floor_ms:.1f} | {r.publish_ms:.1f} | {r.publish_ms / r.floor_ms:.2f} "
            f"| {r.whole_ms:.1f} | {r.whole_ms / r.floor_ms:.2f} | {r.legacy_ms:.1f} "
            f"| {r.legacy_ms / r.floor_ms:.2f} |")
    return "\n".join(lines)


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


DEFAULT_CODEC = PublisherOptions().delta_codec


def run(quick: bool = False, device: str = "cpu") -> str:
    """Run the benchmark; returns Markdown tables (medians per step; sparsity, bytes: means)."""
    cases = [Case("example (llama h256 L4)", 256, 4, 2000, 6 if quick else 21)]
    if not quick:
        cases.append(Case("llama h512 L8", 512, 8, 8000, 11))
    big = cases[-1]
    with tempfile.TemporaryDirectory(prefix="bench-publisher-") as tmp:
        results = [_measure(case, Path(tmp)) for case in cases] if device == "cpu" else []
        trained = Case(big.name, big.hidden, big.layers, big.vocab, 4 if quick else 9)
        runs = sorted((_measure_floor(trained, Path(tmp) / f"run{i}", device)
                       for i in range(1 if quick else FLOOR_RUNS)),
                      key=lambda r: r.whole_ms / r.floor_ms)
        floors = [runs[len(runs) // 2],
                  _measure_floor_synthetic(Path(tmp), device, 3 if quick else 6, quick)]
    spread = ("" if len(runs) == 1 else
              f" The trained model's row is the median of {len(runs)} runs of the same training "
              "(by committed / floor; each run's own medians over its steps): publish() / floor "
              + "-".join(f"{x:.2f}" for x in _span(r.publish_ms / r.floor_ms for r in runs))
              + ", committed / floor "
              + "-".join(f"{x:.2f}" for x in _span(r.whole_ms / r.floor_ms for r in runs))
              + " across the runs.")
    note = ("AdamW (torch, bf16 weights, lr 3e-6), batch 4 x 64 tokens, anchor every 10 steps, "
            f"{DEFAULT_CODEC} (the publisher's default), file:// bucket; "
            f"{torch.get_num_threads()} torch threads.")
    floor_note = (
        "Same training, every step a delta (one anchor first), `flush()` after each `publish()` "
        "(publish -> committed: the diff, encode, write and manifest commit to a file:// bucket). "
        "Snapshot floor: one bf16 copy of every parameter into host buffers allocated once (a "
        "plain memory copy, no page faults), measured in each step right before `publish()`; "
        "the publisher before 0.5 took such a copy into fresh memory every step and then "
        "compared it: the column 'before 0.5' does exactly that to the same weights in the same "
        "step. "
        "Medians over the delta steps. Targets: publish() <= 1.5x the floor, publish -> "
        "committed <= 2.5x (issue 27, 7B shapes) and <= 3x for the trained model (issue 38). "
        "The first row is the trained model (75 tensors, the largest 4.1M elements, ~58 changed "
        "per step): per-chunk costs weigh on it (every changed tensor is one sparse-v3 chunk, "
        "~0.1 ms each to encode), and the commit's fixed costs (two fsync'ed create-only writes, "
        "the data file's then the manifest's link; the manifest is built, checked with the "
        "reader's validation and staged while the data file is written, the second-writer "
        "listing runs while the step encodes); the second has tensors of a 7B model's size (the diff runs on 2 "
        "threads, so it can take less than the single-threaded copy)." + spread)
    out = f"### publish() against the snapshot floor\n\n{floor_note}\n\n{_floor_table(floors)}\n"
    if results:
        out = f"### Publisher\n\n{note}\n\n{_table(results)}\n\n" + out
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Publisher benchmark")
    parser.add_argument("--quick", action="store_true", help="the example model only, 6 steps")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the snapshot-floor row only")
    ns = parser.parse_args()
    print(run(quick=ns.quick, device=ns.device))
