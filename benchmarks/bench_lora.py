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

Serving side (``serving_table``, one run, TP=1 CPU engines of a Llama-shaped toy, hidden 512,
4 layers): decode tokens/s of the base model on a stock vLLM engine, of an engine following the
merged bucket (the adapter merged into the weights, no LoRA kernels), and of an engine
following the adapter bucket (``--enable-lora``; requests name the newest version), with the
same prompts (the extension's engines poll every second, the default, so their idle ticks
cost what they cost a user); on that adapter engine, the engine pause of an adapter step (a new version built
from memory and registered with vLLM's LoRA manager: the switch's apply broadcast) against
vLLM's own ``load_lora_adapter`` with ``load_inplace`` from a local PEFT directory (the path
peers take: ``add_lora`` through the engine client, the directory written beforehand).

    .venv/bin/python -m benchmarks.bench_lora [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from examples.toymodel import build_model, load_hf_model
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.format.adapter import materialize_adapter
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


SERVE_MODEL = {"hidden_size": 512, "num_layers": 4, "num_heads": 16, "num_kv_heads": 4,
               "intermediate_size": 1024, "vocab_size": 1000}
EXTENSION = "vllm_deltasync.DeltaSyncExtension"


def _serve_buckets(root: Path, steps: int) -> tuple[Path, dict[str, Path]]:
    """The toy model, and buckets of a rank-8 LoRA trained with AdamW (lr 1e-5) for ``steps``
    steps: ``base`` (the base weights, step 0), ``merged`` and ``adapter`` (every step), and
    a PEFT directory of each adapter step (``peft-<step>``, what a peer would load)."""
    import peft

    model_dir = build_model(root / "model", "llama", seed=0, **SERVE_MODEL)
    base = load_hf_model(model_dir)
    urls = {name: root / name for name in ("base", "merged", "adapter")}
    with DeltaPublisher(f"file://{urls['base']}") as pub:
        pub.publish(0, [(n, p.detach()) for n, p in base.named_parameters()])
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16,
                                                      target_modules="all-linear"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                            weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    pubs = {mode: DeltaPublisher(f"file://{urls[mode]}", lora=mode, anchor_every=1000)
            for mode in ("merged", "adapter")}
    with contextlib.ExitStack() as stack:
        for pub in pubs.values():
            stack.enter_context(pub)
        for step in range(steps + 1):
            if step:
                ids = torch.randint(2, SERVE_MODEL["vocab_size"], (4, 32), generator=gen)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            for pub in pubs.values():
                pub.publish(step, model)
    for step in range(steps + 1):
        materialize_adapter(f"file://{urls['adapter']}", root / f"peft-{step}", step=step)
    return model_dir, urls


def _release(source: Path, target: Path, step: int) -> None:
    """Step ``step`` of bucket ``source`` into ``target``: its data, then its manifest."""
    for data in sorted((source / "data").glob(f"{step:012d}-*")):
        shutil.copytree(data, target / "data" / data.name)
    (target / "manifests").mkdir(parents=True, exist_ok=True)
    name = f"manifests/{step:012d}.json"
    shutil.copyfile(source / name, target / (name + ".tmp"))
    os.replace(target / (name + ".tmp"), target / name)


@contextlib.contextmanager
def _engine(model_dir: Path, env: dict[str, str], **kw: object) -> Iterator[object]:
    """A TP=1 engine of ``model_dir`` with ``env`` set while it starts (the extension reads its
    ``VLLM_DELTASYNC_*`` variables then)."""
    from vllm import LLM

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        llm = LLM(model=str(model_dir), enforce_eager=True, max_model_len=512, dtype="bfloat16",
                  seed=0, max_num_seqs=8, **kw)  # type: ignore[arg-type]
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()  # type: ignore[attr-defined]


def _decode_tps(llm: object, lora: object, quick: bool) -> float:
    """Decode tokens/s: a batch of 4 prompts, 64 new tokens each (32 quick), median of 3."""
    from vllm import SamplingParams

    tokens = 32 if quick else 64
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 990 + 5 for i in range(16)]}
               for j in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), lora_request=lora,  # type: ignore[attr-defined]
                 use_tqdm=False)
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)  # type: ignore[attr-defined]
        seconds = time.perf_counter() - t0
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
    return statistics.median(rates)


def _wait(llm: object, done: Callable[[dict[str, object]], bool], what: str) -> dict[str, object]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        [status] = llm.collective_rpc("deltasync_status")  # type: ignore[attr-defined]
        if done(status):
            return status  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise TimeoutError(what)


def _version(status: dict[str, object]) -> object:
    """vLLM's LoRARequest of the adapter's newest version, as the API server builds it."""
    from vllm.lora.request import LoRARequest

    from vllm_deltasync.server.api.adapters import version_name, version_path

    step, adapter, identity = status["a"]["versions"][-1]  # type: ignore[index]
    return LoRARequest(version_name("a", step), adapter, version_path("a", step, identity))


def _adapter_engine(model_dir: Path, root: Path, urls: dict[str, Path], steps: int,
                    quick: bool) -> dict[str, object]:
    """Decode tokens/s of the adapter and of the base model on one ``--enable-lora`` engine
    following the adapter; the pause of each adapter step after the first, and of vLLM's
    ``load_inplace`` of the same steps from PEFT directories."""
    from vllm.lora.request import LoRARequest

    live = root / "adapter-live"
    _release(urls["adapter"], live, 0)
    env = {"VLLM_DELTASYNC_URL": f"file://{urls['base']}", "VLLM_DELTASYNC_POLL_INTERVAL_S": "1",
           "VLLM_DELTASYNC_METRICS_PORT": "0",
           "VLLM_DELTASYNC_LORA_URLS": f'{{"a": "file://{live}"}}'}
    out: dict[str, object] = {}
    with _engine(model_dir, env, worker_extension_cls=EXTENSION, enable_lora=True,
                 max_lora_rank=8, max_loras=2, max_cpu_loras=4) as llm:
        status = _wait(llm, lambda s: s["a"]["applied_step"] == 0, "adapter step 0")
        for step in range(1, steps + 1):
            _release(urls["adapter"], live, step)
            status = _wait(llm, lambda s, n=step: s["a"]["applied_step"] == n, f"step {step}")
        out["adapter_tps"] = _decode_tps(llm, _version(status), quick)
        out["lora_engine_base_tps"] = _decode_tps(llm, None, quick)
        report = llm.llm_engine.engine_core.call_utility("deltasync_engine_status")  # type: ignore[attr-defined]
        out["pause_s"] = [s["pause_s"] for s in report["a"]["switches"][1:]]
        out["adapter_bytes"] = statistics.mean(
            s["downloaded_bytes"][0] for s in report["a"]["switches"][1:])
        inplace = []
        for i, step in enumerate(list(range(steps + 1)) * 2):
            t0 = time.perf_counter()
            llm.llm_engine.add_lora(LoRARequest("peer", 7, str(root / f"peft-{step}"),  # type: ignore[attr-defined]
                                                load_inplace=True))
            if i:  # the first call loads a new id; the others reload it in place
                inplace.append(time.perf_counter() - t0)
        out["inplace_s"] = inplace
    return out


def serving_table(quick: bool) -> str:
    """Decode tokens/s (stock, following merged, following the adapter) and the switch pause
    of an adapter step vs vLLM's ``load_inplace`` (module doc). Returns the Markdown."""
    steps = 2 if quick else 4
    with tempfile.TemporaryDirectory(prefix="bench-lora-serve-") as tmp:
        root = Path(tmp)
        os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "cache"))
        os.environ.setdefault("VLLM_RPC_BASE_PATH", tempfile.mkdtemp(prefix="vrpc"))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        started = time.perf_counter()
        model_dir, urls = _serve_buckets(root, steps)
        stock = merged = 0.0  # --quick: the adapter engine only (one engine start)
        if not quick:
            with _engine(model_dir, {}) as llm:
                stock = _decode_tps(llm, None, quick)
            env = {"VLLM_DELTASYNC_URL": f"file://{urls['merged']}",
                   "VLLM_DELTASYNC_POLL_INTERVAL_S": "1", "VLLM_DELTASYNC_METRICS_PORT": "0"}
            with _engine(model_dir, env, worker_extension_cls=EXTENSION) as llm:
                _wait(llm, lambda s: s["applied_step"] == steps, "merged steps")
                merged = _decode_tps(llm, None, quick)
        adapter = _adapter_engine(model_dir, root, urls, steps, quick)
        seconds = time.perf_counter() - started
    pause = [1e3 * p for p in adapter["pause_s"]]  # type: ignore[attr-defined]
    inplace = [1e3 * p for p in adapter["inplace_s"]]  # type: ignore[attr-defined]
    a_tps, b_tps = float(adapter["adapter_tps"]), float(adapter["lora_engine_base_tps"])  # type: ignore[arg-type]
    return "\n".join([
        f"Serving side, one run ({seconds:.0f} s): a Llama-shaped toy (hidden "
        f"{SERVE_MODEL['hidden_size']}, {SERVE_MODEL['num_layers']} layers), a rank-8 LoRA on "
        f"every linear layer trained with AdamW (lr 1e-5), {steps} steps after the anchor; TP=1 "
        "CPU engines; decode: a batch of 4 greedy sequences, "
        f"{32 if quick else 64} new tokens each, median of 3 runs."
        + (" `--quick`: the adapter engine only (its base-model row is the reference; stock and "
           "merged not run)." if quick else ""), "",
        f"| engine | requests | decode tokens/s | vs {'the base model' if quick else 'stock'} |",
        "|---|---|---|---|",
        *([] if quick else [
            f"| stock vLLM (no extension, no LoRA) | base model | {stock:.0f} | 1.00 |",
            f"| following the merged bucket | base model (merged weights) | {merged:.0f} | "
            f"{merged / stock:.2f} |"]),
        f"| following the adapter bucket (`--enable-lora`) | `model=\"a\"` (newest version) | "
        f"{a_tps:.0f} | {a_tps / (b_tps if quick else stock):.2f} |",
        f"| the same engine | base model | {b_tps:.0f} | {b_tps / (b_tps if quick else stock):.2f} |",
        "",
        "Engine pause to serve a new adapter step, same engine (ms, median [min-max]):", "",
        "| path | pause | steps |", "|---|---|---|",
        f"| deltasync adapter step (from the bucket: built from memory, registered as a new "
        f"version; mean {float(adapter['adapter_bytes']) / 1e3:.0f} KB downloaded per step) | "  # type: ignore[arg-type]
        f"{statistics.median(pause):.2f} [{min(pause):.2f}-{max(pause):.2f}] | {len(pause)} |",
        f"| vLLM `load_lora_adapter` with `load_inplace` from a local PEFT directory (the "
        f"engine client's `add_lora`) | {statistics.median(inplace):.2f} "
        f"[{min(inplace):.2f}-{max(inplace):.2f}] | {len(inplace)} |",
    ])


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("llama-h128", 128, 2, 500, warmup=1, steps=2),
                Case("layer-256", 256, 1, 0, warmup=1, steps=2)]
    # the Llama trains in bf16 (slow products on hosts without AVX-512): 3 measured steps
    return [Case("llama-h512", 512, 2, 1000, warmup=2, steps=3),
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
