"""Serving benchmark: decode throughput of a following engine per ``in_flight`` mode against
stock vLLM (CPU build), the KV each switch computes again, the prefix-cache hit rate.

Five engines, started first and alive together (one engine core process each), on the same
model: **stock** (plain vLLM, no extension) and the extension with ``in_flight`` =
**keep_kv** (the default), **continue** and **drain**, every request salted by the weights it
runs on (``server/engine/kv.py``), the default CPU kernels (``packed``); and **keep_kv with
inplace kernels** (linear layers computing from their parameters, as on GPUs: what keeping
vLLM's packed kernels is worth on a host where vLLM packs bf16 linears). The model is a small
Llama, so that 2,048-token sequences fit this machine's time: what a switch costs in
recompute grows with the context, and the decode of an 87M model on these two cores (50
tokens/s at batch 16) would leave no time to measure it.

Before the engines start, an anchor and :data:`STEPS` deltas (~1% of the elements flipped by
1-3 bf16 ulps, as RL steps; REFERENCE §1) are published to a source bucket; each extension
engine follows its own ``file://`` bucket, into which a thread releases one step's manifest
every :data:`INTERVAL_S` seconds while that engine runs (the data files are copied
beforehand: the publisher's encoding does not compete for the cores during the timed runs).

Workloads (greedy, ``ignore_eos``): *short*, 64-token prompts generating 64 tokens (128 in
all); *long*, 1,024-token prompts generating 1,024 (2,048 in all); each with 1 and 16
sequences. The prompts change from run to run (a follower must not reuse blocks of an earlier
run's weights, where stock would), and the 16 prompts of a batch share their first half (a
system prompt: hits within a version).

Rounds (each workload in as many as :data:`WORKLOADS` gives it): in each, every workload
takes a turn on every engine, the starting engine rotating
from round to round, so that the drift of this shared machine's speed falls on all modes
alike; the engine measured runs alone (the others are stopped, SIGSTOP), after a short untimed
generation, and follows while it runs: a turn runs the workload again and again (new prompts)
for at least :data:`TURN_S` seconds, so switches land in it. Tokens/s: generated tokens over
the turn's wall time (prefill included), the median over the rounds; the ratio to stock
is the median over the rounds of each round's ratio (the turns of one round run minutes
apart at most, so the machine's drift cancels in each). Recompute per
switch: the KV tokens of running requests computed again at each switch that landed during
the timed runs (the engine's switch records). Hit rate: prompt tokens served from the prefix
cache over prompt tokens (vLLM's ``num_cached_tokens``), batched workloads whose shared half
fills a KV block.

    .venv/bin/python benchmarks/bench_serving.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.bench_apply import _perturb, _wait_applied, engine_env
from examples.toymodel import build_model
from vllm_deltasync import DeltaPublisher

MODEL: dict[str, Any] = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                         "intermediate_size": 768, "vocab_size": 4096}
MODES = ("stock", "keep_kv", "continue", "drain", "keep_kv, inplace kernels")
"""The engines: stock vLLM, then the extension per ``in_flight`` mode with the default CPU
kernels (``packed``), and ``keep_kv`` computing from the parameters (``cpu_kernels="inplace"``,
as GPUs do): the kernels' share of the following cost."""
STEPS = 40
DENSITY = 0.01
INTERVAL_S = 3.0


@dataclass(frozen=True)
class Workload:
    batch: int
    prompt: int
    generate: int
    rounds: int = 1
    """Interleaved rounds this workload takes part in (the first ``rounds`` of the run)."""

    @property
    def name(self) -> str:
        return f"{self.batch} x {self.prompt + self.generate}"


WORKLOADS = (Workload(1, 64, 64, rounds=2), Workload(16, 64, 64, rounds=2),
             Workload(1, 1024, 1024, rounds=3), Workload(16, 1024, 1024, rounds=1))
"""Rounds per workload: a turn of the batch of 16 long sequences runs ~15 s and sees ~5
switches, so one interleaved turn per engine measures it; a turn of one long sequence runs
~8 s and sees one or two, where one round's ratio moved by +-0.2 on this shared machine: three
rounds (the short workloads' turns are cheap in switches: two)."""
QUICK = (Workload(1, 64, 64), Workload(16, 64, 64), Workload(4, 256, 256))
QUICK_MODES = MODES[:2]
"""``--quick``: stock and the default (``keep_kv``), the headline ratio, two engines to start."""
BLOCK = 128
"""vLLM's KV block on the CPU build: a shared half shorter than this cannot hit."""
TURN_S = 4.0
"""An engine's turn runs its workload again (new prompts each time) until this long has
passed, so that every turn sees switches land (the first release comes ``INTERVAL_S / 2``
into the turn)."""


class _Releaser:
    """Releases the source bucket's manifests into the followed bucket, one per interval,
    while started."""

    def __init__(self, source: Path, target: Path, interval_s: float) -> None:
        self.source, self.target, self.interval_s = source, target, interval_s
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("manifests"))
        (target / "manifests").mkdir()
        self.pending = sorted((source / "manifests").iterdir())
        self.last_step = -1
        self.release()  # the anchor
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def release(self) -> bool:
        if not self.pending:
            return False
        src = self.pending.pop(0)
        tmp = self.target / "manifests" / f".tmp-{src.name}"
        shutil.copyfile(src, tmp)
        tmp.rename(self.target / "manifests" / src.name)
        self.last_step = int(src.stem)
        return True

    def start(self) -> None:
        """Release one step ``interval_s / 2`` from now, then one every ``interval_s``."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wait = self.interval_s / 2
        while not self._stop.wait(wait):
            wait = self.interval_s
            if not self.release():
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _publish(model_dir: Path, bucket: Path, steps: int) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    with DeltaPublisher(f"file://{bucket}", anchor_every=1000) as pub:
        pub.publish(0, tensors.items())
        for step in range(1, steps + 1):
            _perturb(tensors, DENSITY, seed=step)
            pub.publish(step, tensors.items())
        pub.flush()


def _worker_pid(worker: Any) -> int:
    return os.getpid()


def _ppid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise LookupError(f"no PPid for process {pid}")


@dataclass
class _Engine:
    """One mode's engine, alive from start to the end, stopped while another one runs."""

    mode: str
    llm: Any
    releaser: _Releaser | None
    pids: list[int] = field(default_factory=list)
    rates: dict[str, list[float]] = field(default_factory=dict)
    hits: dict[str, list[float]] = field(default_factory=dict)
    switches: list[dict[str, Any]] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)

    def freeze(self) -> None:
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in reversed(self.pids):
            os.kill(pid, signal.SIGCONT)

    @contextlib.contextmanager
    def turn(self) -> Iterator[_Engine]:
        """Running and following (its releaser on), the others stopped; afterwards the steps
        released last are switched to (untimed) and it is stopped again."""
        self.thaw()
        if self.releaser is not None:
            self.releaser.start()
        try:
            yield self
        finally:
            if self.releaser is not None:
                self.releaser.stop()
                with contextlib.suppress(TimeoutError):
                    _wait_applied(self.llm, self.releaser.last_step, timeout_s=60)
            self.freeze()

    def shutdown(self) -> None:
        if self.releaser is not None:
            self.releaser.stop()
        with contextlib.suppress(Exception):
            self.thaw()
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None


def _start(mode: str, model_dir: Path, source: Path, tmp: Path, max_len: int) -> _Engine:
    """The engine of ``mode``; an extension engine follows its own bucket (the anchor only,
    until its turns). The extension reads its ``VLLM_DELTASYNC_*`` settings at start."""
    from vllm import LLM

    releaser = None
    kw: dict[str, Any] = {}
    if mode != "stock":
        slug = mode.replace(", ", "-").replace(" ", "-")
        releaser = _Releaser(source, tmp / f"bucket-{slug}", INTERVAL_S)
        in_flight, _, kernels = mode.partition(", ")
        os.environ.update({"VLLM_DELTASYNC_URL": f"file://{tmp}/bucket-{slug}",
                           "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
                           "VLLM_DELTASYNC_METRICS_PORT": "0",
                           "VLLM_DELTASYNC_IN_FLIGHT": in_flight,
                           "VLLM_DELTASYNC_CPU_KERNELS": kernels.split()[0] if kernels else "packed"})
        kw["worker_extension_cls"] = "vllm_deltasync.DeltaSyncExtension"
    llm = LLM(model=str(model_dir), enforce_eager=True, max_model_len=max_len, dtype="bfloat16",
              seed=0, max_num_seqs=16, enable_prefix_caching=True, **kw)
    engine = _Engine(mode, llm, releaser)
    if releaser is not None:
        _wait_applied(llm, 0)
    worker = llm.collective_rpc(_worker_pid)[0]
    core = _ppid(worker)
    assert _ppid(core) == os.getpid(), (worker, core)
    engine.pids = [core, worker]
    engine.freeze()
    return engine


def _prompts(w: Workload, run: str, vocab: int) -> list[dict[str, list[int]]]:
    """The prompts of run ``run`` of ``w``: new every run, the first half shared by the batch."""
    rng = random.Random(f"{w.name}/{run}")
    shared = [rng.randrange(100, vocab - 100) for _ in range(w.prompt // 2)]
    return [{"prompt_token_ids": shared + [rng.randrange(100, vocab - 100)
                                           for _ in range(w.prompt - len(shared))]}
            for _ in range(w.batch)]


def _turn(engine: _Engine, w: Workload, round_: int, turn_s: float) -> None:
    """One timed turn of ``w`` on ``engine``: runs with new prompts until ``turn_s`` passed;
    its rate and, batched, its hit rate (the same prompts on every engine)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=w.generate, ignore_eos=True)
    started = time.time()
    t0 = time.perf_counter()
    runs = cached = 0
    while runs == 0 or time.perf_counter() - t0 < turn_s:
        outs = engine.llm.generate(_prompts(w, f"{round_}/{runs}", MODEL["vocab_size"]),
                                   params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == w.generate for o in outs)
        cached += sum(o.num_cached_tokens or 0 for o in outs)
        runs += 1
    seconds = time.perf_counter() - t0
    engine.windows.append((started, time.time()))
    engine.rates.setdefault(w.name, []).append(runs * w.batch * w.generate / seconds)
    if w.batch > 1 and w.prompt // 2 >= BLOCK:
        engine.hits.setdefault(w.name, []).append(cached / (runs * w.batch * w.prompt))


def _measure(model_dir: Path, source: Path, tmp: Path, workloads: tuple[Workload, ...],
             turn_s: float, modes: tuple[str, ...] = MODES) -> list[_Engine]:
    """Every mode's engine started first and kept alive, then the rounds (module doc)."""
    import cloudpickle
    from vllm import SamplingParams

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # _worker_pid (bench only)
    max_len = max(w.prompt + w.generate for w in workloads) + 16
    engines: list[_Engine] = []
    try:
        for mode in modes:
            engines.append(_start(mode, model_dir, source, tmp, max_len))
        warm = [{"prompt_token_ids": [101, 102, 103]}]
        for round_ in range(max(w.rounds for w in workloads)):
            order = engines[round_ % len(engines):] + engines[:round_ % len(engines)]
            for w in workloads:
                if round_ >= w.rounds:
                    continue
                for engine in order:
                    with engine.turn():
                        engine.llm.generate(warm, SamplingParams(max_tokens=4), use_tqdm=False)
                        _turn(engine, w, round_, turn_s)
                print(f"bench_serving: round {round_} {w.name} done", file=sys.stderr)
        for engine in engines:
            if engine.releaser is not None:
                engine.thaw()
                status = engine.llm.llm_engine.engine_core.call_utility(
                    "deltasync_engine_status")
                engine.freeze()
                engine.switches = [s for s in status["switches"] if s["step"] > 0 and any(
                    a <= s["at"] <= b for a, b in engine.windows)]
    finally:
        for engine in engines:
            engine.shutdown()
    return engines


def _median(values: list[float], fmt: str) -> str:
    return format(statistics.median(values), fmt) if values else "-"


def _table(rows: list[_Engine], workloads: tuple[Workload, ...]) -> list[str]:
    stock = rows[0]
    batched = [w for w in workloads if w.batch > 1 and w.prompt // 2 >= BLOCK]
    lines = [
        "| mode | " + " | ".join(f"{w.name}: tokens/s" for w in workloads)
        + " | switches in runs | recompute tokens / switch | "
        + " | ".join(f"hit rate {w.name}" for w in batched) + " |",
        "|---|" + "---|" * (len(workloads) + 2 + len(batched)),
    ]
    for r in rows:
        cells = []
        for w in workloads:
            ratio = statistics.median(a / b for a, b in zip(r.rates[w.name], stock.rates[w.name],
                                                            strict=True))
            cells.append(f"{statistics.median(r.rates[w.name]):.0f} ({ratio:.2f})")
        sw = r.switches
        recompute = (f"{statistics.mean(s['recompute_tokens'] for s in sw):.0f}" if sw
                     else "-")
        lines.append(
            f"| {r.mode} | " + " | ".join(cells)
            + f" | {len(sw) if r.releaser is not None else '- (follows nothing)'}"
            + f" | {recompute if r.releaser is not None else '-'} | "
            + " | ".join(_median(r.hits.get(w.name, []), ".2f") for w in batched) + " |")
    return lines


def run(quick: bool = False) -> str:
    """Markdown section: one row per mode."""
    workloads, turn_s = (QUICK, 2.0) if quick else (WORKLOADS, TURN_S)
    modes = QUICK_MODES if quick else MODES
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp_name:
        tmp = Path(tmp_name)
        engine_env(tmp)
        model_dir = build_model(tmp / "model", "llama", **MODEL)
        from safetensors.torch import load_file

        params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
        source = tmp / "source"
        _publish(model_dir, source, 16 if quick else STEPS)
        rows = _measure(model_dir, source, tmp, workloads, turn_s, modes)
    lines = [
        "## serving: following throughput per in_flight mode vs stock vLLM (TP=1)",
        "",
        f"Llama {params / 1e6:.1f}M (hidden {MODEL['hidden_size']}, {MODEL['num_layers']} "
        f"layers). Each extension engine follows its bucket while it runs: a ~{DENSITY:.0%} "
        f"delta every {INTERVAL_S:.0f} s. Workloads `batch x (prompt + generated)` tokens, each "
        f"turn of an engine running one again (new prompts) for at least {turn_s:.0f} s; "
        "tokens/s generated (prefill included), the median over the interleaved rounds ("
        + ", ".join(f"{w.name}: {w.rounds}" for w in workloads)
        + "; a turn of 16 x 2048 runs ~15 s and sees several switches), and in brackets the "
        "median of each round's ratio to stock's turn of that round. The engines are alive "
        "together, the starting engine rotating each round; the engine measured runs alone, "
        "the others stopped (SIGSTOP).",
        "",
        *_table(rows, workloads),
        "",
        "CPU kernels `packed` (the default: vLLM's packed GEMM kernels kept, the layers a switch "
        "wrote packed again) but in the last row, `inplace` (linear layers computing from "
        "their parameters, as GPUs do). "
        "keep_kv: running requests continue on the new weights from the KV computed so far; "
        "continue: they are preempted and compute their KV again on the new weights (the "
        "recompute tokens); drain: new requests wait until the running ones finish, then the "
        "step applies (its switches fall between runs). Every mode salts each request's "
        "prefix-cache blocks with the weights it runs on: hits only within a version, none of "
        "a switch's old blocks dropped. Switches in runs: the switches that landed during the "
        "timed runs. Hit rate: prompt tokens read from the prefix cache (the 16 prompts of a "
        "batch share their first half; no prompt is reused across runs; the short prompts fill no "
        "128-token block). This machine's two "
        "cores are shared and its speed drifts by up to ~15% over minutes.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="stock and keep_kv only, short workloads and a 512-token batch of 4, one round")
    print(run(quick=parser.parse_args().quick))


if __name__ == "__main__":
    main()
