"""LoRA benchmark: what a LoRA policy changes per step, and what each publishing mode costs.

Trainer side (measured here): a Llama-shaped toy (examples/toymodel.py, built locally) with a
PEFT LoRA adapter on every linear layer (rank 8 and 64), bf16 base weights and PEFT's float32
adapter, trained with AdamW at lr 1e-6, 1e-5 and 1e-4; and a single 2048x2048 bf16 layer (the
shape the issue quotes) trained on a regression loss. Per step after a warm-up:

* the fraction of bf16 elements of the merged adapted weights that change (what
  ``DeltaPublisher.publish(step, peft_model)`` publishes, merged by trainer/lora.py bit for
  bit as ``merge_and_unload()``), and of the adapter's own ``A`` and ``B`` (rounded to bf16,
  as ``lora="adapter"`` publishes them);
* bytes per step of the two modes through real publishers to ``file://`` buckets (every
  step's manifest totals: data bytes; the manifest itself beside them).

Serving side (decode tokens/s with the adapter merged vs. a LoRARequest, the pause of a
switch): not measured yet, see ``serving_table``.

    .venv/bin/python -m benchmarks.bench_lora [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from examples.toymodel import build_model, load_hf_model
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.trainer.lora import merged_tensors

LRS = (1e-6, 1e-5, 1e-4)
RANKS = (8, 64)


@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    layers: int
    vocab: int
    warmup: int
    steps: int


@dataclass
class Run:
    """What one (case, rank, lr) training run measured, per measured step."""

    merged: list[float] = field(default_factory=list)
    """Fraction of the adapted weights' merged bf16 elements changed."""
    lora_a: list[float] = field(default_factory=list)
    lora_b: list[float] = field(default_factory=list)
    bytes: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    """mode -> (data bytes, manifest bytes, changed elements) of each measured delta step."""
    anchor_bytes: dict[str, int] = field(default_factory=dict)
    elements: dict[str, int] = field(default_factory=dict)
    """mode -> elements one step of that mode covers (the whole parameter set)."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16).contiguous().view(torch.int16).reshape(-1).clone()


def _changed(new: list[torch.Tensor], old: list[torch.Tensor]) -> float:
    return sum(int(a.ne(b).sum()) for a, b in zip(new, old, strict=True)) / sum(a.numel() for a in new)


class _Sampler:
    """bf16 bits of the merged adapted weights and of ``A``, ``B`` at each step; changes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.adapted = {n.replace("base_model.model.", "", 1).replace(".base_layer", "")
                        for n, _ in model.named_parameters() if ".base_layer." in n}
        self.last: dict[str, list[torch.Tensor]] | None = None

    def sample(self) -> dict[str, list[torch.Tensor]]:
        merged = [_bits(t) for n, t in merged_tensors(self.model) if n in self.adapted]
        named = dict(self.model.named_parameters())
        return {"merged": merged,
                "lora_a": [_bits(t) for n, t in named.items() if ".lora_A." in n],
                "lora_b": [_bits(t) for n, t in named.items() if ".lora_B." in n]}

    def step(self, run: Run, measure: bool) -> None:
        now = self.sample()
        if measure and self.last is not None:
            run.merged.append(_changed(now["merged"], self.last["merged"]))
            run.lora_a.append(_changed(now["lora_a"], self.last["lora_a"]))
            run.lora_b.append(_changed(now["lora_b"], self.last["lora_b"]))
        self.last = now


def _llama(case: Case, workdir: Path) -> torch.nn.Module:
    path = build_model(workdir / case.name, "llama", hidden_size=case.hidden, num_layers=case.layers,
                       num_heads=case.hidden // 32, num_kv_heads=case.hidden // 64,
                       intermediate_size=2 * case.hidden, vocab_size=case.vocab, seed=0)
    model = load_hf_model(path, dtype=torch.bfloat16)
    model.train()
    return model


def _layer_2048(case: Case, _: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.Linear(case.hidden, case.hidden, bias=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.02)
    return torch.nn.Sequential(layer)


def _loss(case: Case, model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
    if case.vocab:
        ids = torch.randint(0, case.vocab, (4, 64), generator=gen)
        return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]
    x = torch.randn(8, case.hidden, generator=gen).to(torch.bfloat16)
    return (model(x).float() - x.float()).square().mean()


def _train(case: Case, rank: int, lr: float, workdir: Path) -> Run:
    import peft

    build = _llama if case.vocab else _layer_2048
    targets = "all-linear" if case.vocab else ["0"]
    model = peft.get_peft_model(build(case, workdir), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    run, sampler = Run(), _Sampler(model)
    publish = _publishers(run, workdir / f"{case.name}-r{rank}-lr{lr:g}", case.warmup)
    for step in range(case.warmup + case.steps):
        _loss(case, model, gen).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sampler.step(run, measure=step >= case.warmup)
        publish(step, model)
    publish(-1, model)
    return run


def _publishers(run: Run, root: Path, warmup: int) -> Callable[[int, torch.nn.Module], None]:
    """Publish every step in both modes to file:// buckets under ``root`` and record the
    totals of each delta from step ``warmup`` on into ``run`` (step -1: flush and close)."""
    manifests: dict[str, dict[int, Manifest]] = {"merged": {}, "adapter": {}}

    def keep(into: dict[int, Manifest]) -> Callable[[Manifest], None]:
        return lambda m: into.__setitem__(m.step, m)

    pubs = {mode: DeltaPublisher(f"file://{root}/{mode}", anchor_every=1000, lora=mode,
                                 on_commit=keep(manifests[mode]))
            for mode in manifests}

    def publish(step: int, model: torch.nn.Module) -> None:
        if step >= 0:
            for pub in pubs.values():
                pub.publish(step, model)
            return
        for mode, pub in pubs.items():
            pub.close()
            ms = sorted(manifests[mode].values(), key=lambda m: m.step)
            run.anchor_bytes[mode] = ms[0].totals.bytes
            run.elements[mode] = ms[0].totals.elements
            run.bytes[mode] = [(m.totals.bytes, len(m.to_json()), m.totals.changed)
                               for m in ms if m.kind == "delta" and m.step >= warmup]

    return publish


def _pct(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):.2f}" if values else "n/a"


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f}"


def measure(cases: list[Case], workdir: Path) -> dict[tuple[str, int, float], Run]:
    return {(case.name, rank, lr): _train(case, rank, lr, workdir)
            for case in cases for rank in RANKS for lr in LRS}


def sparsity_table(runs: dict[tuple[str, int, float], Run]) -> str:
    lines = ["Changed bf16 elements per step (mean over the measured steps):", "",
             "| model | rank | lr | merged adapted weights % | lora_A % | lora_B % |",
             "|---|---|---|---|---|---|"]
    for (name, rank, lr), run in runs.items():
        lines.append(f"| {name} | {rank} | {lr:g} | {_pct(run.merged)} | {_pct(run.lora_a)} | "
                     f"{_pct(run.lora_b)} |")
    return "\n".join(lines)


def bytes_table(runs: dict[tuple[str, int, float], Run]) -> str:
    lines = ["Bytes per delta step through real publishers (manifest totals; `merged`: the whole "
             "model's merged weights, `adapter`: the adapter's tensors in bf16). Data MB and the "
             "manifest's own KB per step, mean over the measured steps; the first anchor's MB:", "",
             "| model | rank | lr | merged MB | merged changed % | adapter MB | adapter changed % "
             "| adapter manifest KB | anchors MB (merged / adapter) | merged / adapter |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (name, rank, lr), run in runs.items():
        m, a = run.bytes.get("merged", []), run.bytes.get("adapter", [])
        if not m or not a:
            continue
        mb, ab = (statistics.mean(x[0] for x in rows) for rows in (m, a))
        mc, ac = (statistics.mean(x[2] for x in rows) / run.elements[mode]
                  for rows, mode in ((m, "merged"), (a, "adapter")))
        lines.append(f"| {name} | {rank} | {lr:g} | {_mb(mb)} | {100 * mc:.2f} | {_mb(ab)} | "
                     f"{100 * ac:.2f} | {statistics.mean(x[1] for x in a) / 1e3:.1f} | "
                     f"{_mb(run.anchor_bytes['merged'])} / {_mb(run.anchor_bytes['adapter'])} | "
                     f"{mb / ab:.1f}x |")
    return "\n".join(lines)


def serving_table(quick: bool) -> str:
    """SERVING PART: TO BE WRITTEN (the lead's part of issue 35).

    Decode tokens/s with the policy merged into the weights vs. served as a LoRARequest of the
    materialized adapter (format/adapter.py), and the generation pause of a switch in each
    mode, on the same toy. Returns the Markdown rows."""
    return "Serving (decode tokens/s merged vs. adapter, switch pause): not measured yet."


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("llama-h128", 128, 2, 500, warmup=1, steps=2),
                Case("layer-256", 256, 1, 0, warmup=1, steps=2)]
    return [Case("llama-h512", 512, 2, 1000, warmup=2, steps=4),
            Case("layer-2048", 2048, 1, 0, warmup=2, steps=4)]


def run(quick: bool = False) -> str:
    chosen = cases(quick)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        runs = measure(chosen, Path(tmp))
    described = "; ".join(
        f"`{c.name}`: " + (f"Llama hidden {c.hidden}, {c.layers} layers, vocab {c.vocab}, LoRA on "
                           "every linear layer" if c.vocab else
                           f"one {c.hidden}x{c.hidden} bf16 layer, LoRA on it")
        + f", {c.warmup} warm-up + {c.steps} measured AdamW steps" for c in chosen)
    return "\n\n".join([
        f"Trainer side. {described}; alpha = 2 x rank, PEFT's float32 adapter on bf16 base "
        "weights, weight decay 0.",
        sparsity_table(runs), bytes_table(runs), "### serving\n\n" + serving_table(quick)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))
