"""Scale model of a 1T-parameter MoE deployment: one EP rank's real share, published over hf://.

One rank of a DeepSeek-V3-shaped MoE (hidden 7168, 256 routed experts of intermediate 2048 plus
one shared expert, expert parallelism EP=32, so 8 routed experts per rank per layer) holds, per
MoE layer, 8 routed experts x (``gate_proj``, ``up_proj`` [2048, 7168], ``down_proj`` [7168,
2048]) in bf16 (~0.70 GB) plus the shared expert. **Shared expert: replicated** (every rank
holds the whole shared expert of every layer, as with DP attention + EP, where shared experts
are not split), so each rank downloads its delta too (the conservative choice for bytes:
TP-splitting it would cut that part 8x). Two layers are measured with checkpoint names
(``model.layers.{L}.mlp.experts.{E}.gate_proj.weight``, ``...shared_experts.up_proj.weight``).

The trainer publishes an anchor, then delta steps with :class:`DeltaPublisher` to the local Hub
bucket server (``tests/helpers/hubserver.py``, run in its own process, loopback, no bandwidth
limit; it counts the requests). Each delta step changes 1% of every tensor's elements at
uniformly random positions; the bf16 bit-pattern difference (int16, new - old) has
|d| = 1 (70%), 2 (20%), 3 (4%), 4 (4%), 5..16 uniform (2%), sign +/- at random.

Measured per rank (= per node here) for a delta step: Hub requests (at the server), bytes
fetched, publish seconds, download seconds, verify + decode seconds with 1 and 2 threads
(torch intra-op threads 1; the thread pool decodes independent chunks), apply seconds (in-place
``TensorPatch.apply_to`` scatter into a bf16 copy of the base, one thread), bit-exactness
against the trainer's new tensors (asserted), and peak staging memory (growth of VmHWM over
VmRSS after resetting VmHWM through ``/proc/self/clear_refs``, over the real reader path that
holds every decoded patch of the step). The codec's encode is timed at 1 and 2 threads
(bench_codec's method) on the step's changes, sha256 at one thread.

Then the deployment model (benchmarks/scale_model.py): publish -> applied for DeepSeek-V3 and a
1T of Kimi-K2's shape, from the rates measured here per changed element, the plan of one EP
rank measured on the full-size manifests (benchmarks/manifest_1t.py: every tensor, chunk tables
as written, one core, median of 5), and named assumptions, each halved and doubled in a
sensitivity table.

Memory: tensors are generated one at a time; the reader's base copy is rebuilt per tensor from
the new tensor and the known ground-truth differences, so peak RSS stays ~3 copies of the share.

    .venv/bin/python -m benchmarks.bench_scale [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch

from benchmarks import manifest_1t
from benchmarks.scale_model import Measured
from benchmarks.scale_model import render as render_model
from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.codecs import get_codec
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.stores import open_store
from vllm_deltasync.trainer.publisher import DeltaPublisher

ROOT = Path(__file__).resolve().parents[1]
"""The repository: the local Hub bucket server is ``tests.helpers.hubserver`` there."""
BUCKET = "bench/scale"
HIDDEN, INTER = 7168, 2048
ROUTED, EP = 256, 32
DENSITY = 0.01
# |d| distribution of the bf16 bit-pattern differences (measured RL steps: mostly 1-2 ulps)
MAGNITUDES = [1, 2, 3, 4, *range(5, 17)]
PROBS = [0.70, 0.20, 0.04, 0.04, *([0.02 / 12] * 12)]

_SERVER = r"""
import json, sys
from tests.helpers.hubserver import HubServer
with HubServer() as hub:
    print(json.dumps({"endpoint": hub.endpoint, "token": hub.token}), flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        counts = {}  # what was served since the last reset, reported before the command
        for r in hub.requests():
            counts[r["kind"]] = counts.get(r["kind"], 0) + 1
        print(json.dumps({"counts": counts, "cdn_bytes": hub.cdn_bytes_served}), flush=True)
        if cmd == "create":
            hub.create_bucket(arg)
        elif cmd == "reset":
            hub.log.clear(); hub.cdn_bytes_served = 0
        elif cmd == "drop":
            hub.buckets[arg] = {}; hub.blobs.clear()
"""


class Server:
    """The local Hub bucket server in a subprocess (off this process's GIL and RSS)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        info = json.loads(self.proc.stdout.readline())
        self.endpoint, self.token = info["endpoint"], info["token"]

    def command(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        result: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return result

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)

    def options(self, bucket: str) -> dict[str, Any]:
        endpoint, token = self.endpoint, self.token

        async def upload(items: list[tuple[str, bytes]]) -> None:  # stand-in for the Xet upload
            async with aiohttp.ClientSession() as session:
                for path, data in items:
                    url = f"{endpoint}/_test/upload/{bucket}/{path}"
                    async with session.put(url, data=data,
                                           headers={"Authorization": f"Bearer {token}"}) as r:
                        r.raise_for_status()

        return {"endpoint": endpoint, "token": token, "environ": {}, "uploader": upload}


# -- the rank's share --------------------------------------------------------------------------


def shapes(layers: int, experts: int) -> dict[str, tuple[int, int]]:
    """Checkpoint names and shapes of one rank's share: routed experts (rank 0 holds experts
    0..experts-1) and the replicated shared expert, per layer (layer numbers of MoE layers)."""
    out: dict[str, tuple[int, int]] = {}
    for layer in range(3, 3 + layers):  # DeepSeek-V3: layers 0-2 are dense
        prefix = f"model.layers.{layer}.mlp"
        for owner in [f"experts.{e}" for e in range(experts)] + ["shared_experts"]:
            out[f"{prefix}.{owner}.gate_proj.weight"] = (INTER, HIDDEN)
            out[f"{prefix}.{owner}.up_proj.weight"] = (INTER, HIDDEN)
            out[f"{prefix}.{owner}.down_proj.weight"] = (HIDDEN, INTER)
    return out


def make_tensors(names: dict[str, tuple[int, int]], seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights (std 0.02), generated one tensor at a time."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in names.items():
        out[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    return out


def step_tensors(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One training step in place: 1% of each tensor's elements move by a few ulps.
    Returns the ground truth per tensor: (sorted flat positions, int16 differences)."""
    rng = np.random.default_rng(seed)
    truth = {}
    for name, t in tensors.items():
        n = t.numel()
        k = round(n * DENSITY)
        idx = np.unique(rng.integers(0, n, int(k * 1.01) + 64))
        if idx.size > k:
            idx = np.sort(rng.choice(idx, k, replace=False))
        mag = rng.choice(np.array(MAGNITUDES, dtype=np.int16), idx.size, p=PROBS)
        sign = rng.integers(0, 2, idx.size, dtype=np.int16) * 2 - 1
        d = (mag * sign).astype(np.int16)
        bits = t.view(torch.int16).numpy().reshape(-1)
        bits[idx] += d  # int16 arithmetic wraps like the codec's mod 2**16
        truth[name] = (idx, d)
    return truth


# -- memory ------------------------------------------------------------------------------------


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


_PEAK = [0]
"""The highest VmHWM seen before a reset (the benchmark's own peak RSS)."""


def reset_peak() -> bool:
    _PEAK[0] = max(_PEAK[0], _status("VmHWM"))
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# -- reader side -------------------------------------------------------------------------------


async def _real_path(server: Server, bucket: str, url: str, base: int, step: int) -> dict[str, Any]:
    """What a rollout server does: plan from its applied step, iter_patches (download, verify,
    decode), holding every patch of the step until it is applied."""
    reader = BucketReader(open_store(url, **server.options(bucket)))
    try:
        t0 = time.perf_counter()
        chain = await reader.plan(base, step)
        assert [m.step for m in chain] == [step], [m.step for m in chain]
        patches = [p async for p in reader.iter_patches(chain[0])]
        return {"manifest": chain[0], "patches": patches, "seconds": time.perf_counter() - t0}
    finally:
        await reader.close()


async def _download(server: Server, bucket: str, url: str, step: int) -> tuple[Any, dict[str, bytes], float]:
    """Download only: the manifest and every data file of ``step``, 8 at a time."""
    reader = BucketReader(open_store(url, **server.options(bucket)))
    try:
        t0 = time.perf_counter()
        m = await reader.manifest(step)
        slots = asyncio.Semaphore(8)

        async def one(path: str) -> tuple[str, bytes]:
            async with slots:
                return path, await reader.store.read(path)

        files = dict(await asyncio.gather(*(one(f.path) for f in m.files)))
        return m, files, time.perf_counter() - t0
    finally:
        await reader.close()


def verify_decode(m: Any, files: dict[str, bytes], threads: int) -> tuple[list[TensorPatch], float]:
    """Verify (file sha256, then each chunk's sha256) and decode every chunk of ``m`` from the
    downloaded bytes with the reader's own code, on a pool of ``threads`` threads."""
    reader = BucketReader(store=None)  # type: ignore[arg-type]  # only its decode path is used
    views = {path: memoryview(data) for path, data in files.items()}

    def check(entry: Any) -> None:
        if hashlib.sha256(files[entry.path]).hexdigest() != entry.sha256:
            raise AssertionError(f"{entry.path}: sha256 mismatch")

    def decode(entry: Any, chunk: Any) -> TensorPatch:
        view = views[m.files[chunk.file].path]
        return reader._chunk_patch(m, entry, chunk, lambda o, n: view[o : o + n])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        checks = [pool.submit(check, f) for f in m.files]
        futures = [pool.submit(decode, e, c) for e in m.tensors for c in e.chunks]
        for f in checks:
            f.result()
        patches = [f.result() for f in futures]
    return patches, time.perf_counter() - t0


def apply_and_check(tensors: dict[str, torch.Tensor], truth: dict[str, tuple[np.ndarray, np.ndarray]],
                    patches: list[TensorPatch]) -> tuple[float, int]:
    """Apply the step's patches in place into a bf16 copy of each base tensor (rebuilt from the
    new tensor and the ground truth) and assert the result equals the trainer's new tensor."""
    by_name: dict[str, list[TensorPatch]] = {}
    for p in patches:
        by_name.setdefault(p.name, []).append(p)
    assert set(by_name) == set(tensors), "a tensor got no patch"
    seconds, changed = 0.0, 0
    for name, new in tensors.items():
        base = new.detach().clone().view(-1)
        idx, d = truth[name]
        bits = base.view(torch.int16).numpy()
        bits[idx] -= d  # the rollout server's copy of the previous step
        t0 = time.perf_counter()
        for p in by_name[name]:
            p.apply_to(base)
        seconds += time.perf_counter() - t0
        changed += sum(int(p.values.numel()) for p in by_name[name])
        if not torch.equal(base.view(torch.int16), new.view(-1).view(torch.int16)):
            raise AssertionError(f"{name}: not bit-exact after apply")
        del base
    return seconds, changed


# -- encode at 1 and 2 threads -------------------------------------------------------------------


def measure_encode(codec: str, tensors: dict[str, torch.Tensor],
                   truth: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """The codec's encode of this step's changes, tensors spread over a pool of 1 or 2 threads
    (bench_codec's method), best of 3 each, interleaved; sha256's rate at one thread."""
    work = []
    for name, (idx, d) in truth.items():
        positions = torch.from_numpy(idx)
        new = tensors[name].view(-1)[positions]
        old = (new.view(torch.int16) - torch.from_numpy(d)).view(torch.bfloat16)
        work.append((positions, new, old))
    enc = get_codec(codec)
    walls = {1: float("inf"), 2: float("inf")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(2) as pool:
            for _ in range(3):
                for n in (1, 2):
                    t0 = time.perf_counter()
                    if n == 1:
                        for w in work:
                            enc.encode(*w)
                    else:
                        list(pool.map(lambda w: enc.encode(*w), work))
                    walls[n] = min(walls[n], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    block = bytes(64 << 20)
    sha = min(_timed(lambda: hashlib.sha256(block).digest()) for _ in range(3))
    return {"changed": float(sum(w[0].numel() for w in work)), "wall1_s": walls[1],
            "wall2_s": walls[2], "sha_gbps": len(block) / sha / 1e9}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- one codec ---------------------------------------------------------------------------------


def measure_codec(server: Server, codec: str, tensors: dict[str, torch.Tensor], deltas: int,
                  seed: int) -> list[dict[str, Any]]:
    bucket = f"{BUCKET}-{codec}"
    server.command(f"create {bucket}")
    url = f"hf://buckets/{bucket}/run"
    rows = []
    threads = torch.get_num_threads()
    with DeltaPublisher(url, codec=codec, anchor_every=1000, store_options=server.options(bucket)) as pub:
        t0 = time.perf_counter()
        pub.publish(0, tensors)
        pub.flush()
        anchor_s = time.perf_counter() - t0
        anchor_bytes = pub.stats.bytes_written
        for k in range(1, deltas + 1):
            truth = step_tensors(tensors, seed + k)
            encoded = measure_encode(codec, tensors, truth) if k == 1 else None
            gc.collect()
            t0 = time.perf_counter()
            pub.publish(k, tensors)
            pub.flush()
            publish_s = time.perf_counter() - t0
            _, diff_s, upload_s = pub.stats.per_step[-1]
            manifest = pub.stats.last_manifest
            assert manifest is not None and manifest.step == k

            server.command("reset")
            gc.collect()
            rss0 = _status("VmRSS")
            peak_ok = reset_peak()
            real = asyncio.run(_real_path(server, bucket, url, k - 1, k))
            staged_peak = _status("VmHWM") - rss0 if peak_ok else -1
            seen = server.command("reset")
            real_patches = real.pop("patches")
            staged_values = sum(p.values.numel() * p.values.element_size() + (
                0 if p.indices is None else p.indices.numel() * p.indices.element_size())
                for p in real_patches)
            del real_patches
            gc.collect()

            m, files, download_s = asyncio.run(_download(server, bucket, url, k))
            fetched = server.command("reset")
            decoded: dict[int, float] = {1: float("inf"), 2: float("inf")}
            torch.set_num_threads(1)  # per core: parallelism comes from the pool only
            try:
                for _ in range(3):  # interleaved, best of 3: the cores are shared
                    for n in (1, 2):
                        patches, seconds = verify_decode(m, files, n)
                        decoded[n] = min(decoded[n], seconds)
                apply_s, changed = apply_and_check(tensors, truth, patches)
            finally:
                torch.set_num_threads(threads)
            del patches, files, truth
            gc.collect()
            rows.append({
                "codec": codec, "step": k, "anchor_s": anchor_s, "anchor_bytes": anchor_bytes,
                "changed": changed, "elements": sum(t.numel() for t in tensors.values()),
                "publish_s": publish_s, "diff_s": diff_s, "upload_s": upload_s,
                "step_bytes": manifest.totals.bytes, "data_files": len(manifest.files),
                "requests": seen["counts"], "fetched": seen["cdn_bytes"],
                "real_s": real["seconds"], "download_s": download_s,
                "download_requests": fetched["counts"], "download_bytes": fetched["cdn_bytes"],
                "decode1_s": decoded[1], "decode2_s": decoded[2], "apply_s": apply_s,
                "staged_peak": staged_peak, "staged_values": staged_values, "encode": encoded,
            })
    server.command(f"drop {bucket}")
    return rows


LAYOUT_SHRINK = 32
"""The request-layout model divides both dimensions of every tensor by this (elements by its
square) and the publisher's ``max_file_bytes`` by its square, so files break at the same
places relative to the data as with full-size tensors."""


def layout_names(layers: int) -> dict[str, tuple[int, int]]:
    """Every MoE tensor of ``layers`` layers of the full model (all 256 routed experts, the
    router, the shared expert, in DeepSeek-V3's module order), shrunk by ``LAYOUT_SHRINK``."""
    h, i = HIDDEN // LAYOUT_SHRINK, INTER // LAYOUT_SHRINK
    out: dict[str, tuple[int, int]] = {}
    for layer in range(3, 3 + layers):
        prefix = f"model.layers.{layer}.mlp"
        for e in range(ROUTED):
            out[f"{prefix}.experts.{e}.gate_proj.weight"] = (i, h)
            out[f"{prefix}.experts.{e}.up_proj.weight"] = (i, h)
            out[f"{prefix}.experts.{e}.down_proj.weight"] = (h, i)
        out[f"{prefix}.gate.weight"] = (ROUTED, h)
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            out[f"{prefix}.shared_experts.{proj}.weight"] = shape
    return out


def rank0(name: str) -> bool:
    """What EP rank 0 reads: routed experts 0..7, the router and the shared expert (replicated)."""
    if ".experts." not in name:
        return True
    return int(name.split(".experts.")[1].split(".")[0]) < ROUTED // EP


def measure_layout(server: Server, layers: int, codec: str) -> dict[str, Any]:
    """Requests and manifest bytes of one rank when the bucket holds the whole model's delta
    (every rank's experts): rank 0 range-reads its own chunks through ``iter_patches``."""
    bucket = f"{BUCKET}-layout"
    server.command(f"create {bucket}")
    url = f"hf://buckets/{bucket}/run"
    tensors = make_tensors(layout_names(layers), seed=7)
    with DeltaPublisher(url, codec=codec, max_file_bytes=(256 << 20) // LAYOUT_SHRINK**2,
                        store_options=server.options(bucket)) as pub:
        pub.publish(0, tensors)
        step_tensors(tensors, seed=8)
        pub.publish(1, tensors)
        pub.flush()
        manifest = pub.stats.last_manifest
        assert manifest is not None
    server.command("reset")

    async def read() -> tuple[int, float, float]:
        reader = BucketReader(open_store(url, **server.options(bucket)))
        try:
            t0 = time.perf_counter()
            chain = await reader.plan(0, 1)
            plan_s = time.perf_counter() - t0
            n = sum([p.values.numel() async for p in reader.iter_patches(chain[0], select=rank0)])
            return n, plan_s, time.perf_counter() - t0
        finally:
            await reader.close()

    changed, plan_s, total_s = asyncio.run(read())
    seen = server.command(f"drop {bucket}")
    return {"layers": layers, "tensors": len(tensors), "files": len(manifest.files),
            "manifest_bytes": len(manifest.to_json()), "requests": seen["counts"],
            "fetched": seen["cdn_bytes"], "plan_s": plan_s, "total_s": total_s,
            "changed": changed, "selected": BucketReader.selected_bytes(manifest, rank0)}


def measure(quick: bool) -> dict[str, Any]:
    layers, experts = (1, 2) if quick else (2, ROUTED // EP)
    codecs = ["sparse-v3", "sparse-v2"]  # sparse-v3: DeltaPublisher's default
    try:
        get_codec("sparse-v3")
    except FormatError:
        codecs = ["sparse-v2"]
    if quick:  # the smoke test: the default codec only
        codecs = codecs[:1]
    t0 = time.perf_counter()
    tensors = make_tensors(shapes(layers, experts))
    gen_s = time.perf_counter() - t0
    share, n_tensors = sum(t.numel() * t.element_size() for t in tensors.values()), len(tensors)
    server = Server()
    rows: list[dict[str, Any]] = []
    try:
        for i, codec in enumerate(codecs):
            # one step each: the decode inside a step is already the best of 3 interleaved runs
            rows += measure_codec(server, codec, tensors, deltas=1, seed=100 * i)
        del tensors
        gc.collect()
        layout = measure_layout(server, layers, codecs[0])
    finally:
        server.close()
    plans = {name: manifest_1t.plan_inputs(name, runs=1 if quick else manifest_1t.RUNS,
                                           full=0 if quick or name != "1T (Kimi-K2 shape)" else 1)
             for name in manifest_1t.MODELS}
    return {"layers": layers, "experts": experts, "share_bytes": share, "tensors": n_tensors,
            "layout": layout, "plans": plans, "encode": rows[0]["encode"],
            "rows": rows, "gen_s": gen_s, "peak_rss": max(_PEAK[0], _status("VmHWM")), "load": os.getloadavg()[0], "codecs": codecs}


# -- report ------------------------------------------------------------------------------------


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _req(counts: dict[str, int]) -> str:
    return f"{sum(counts.values())} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})"


def render(r: dict[str, Any]) -> str:
    layers, experts = r["layers"], r["experts"]
    lines = [
        f"### Scale model: one EP rank of a DeepSeek-V3-shaped MoE ({layers} MoE layer(s) x "
        f"({experts} routed + 1 shared expert), hidden {HIDDEN}, expert intermediate {INTER}; "
        f"EP={EP} => {ROUTED // EP} routed experts per rank per layer in the full model)",
        "",
        f"Share measured: {r['tensors']} tensors, {_gb(r['share_bytes'])} bf16 (shared expert "
        f"replicated on every rank). Steps: 1% of each tensor's elements, random positions, "
        f"|d| = 1 ulp 70%, 2: 20%, 3: 4%, 4: 4%, 5-16: 2%. Transport: hf:// against the local Hub "
        f"bucket server on loopback (own process, no bandwidth limit). Publish: DeltaPublisher "
        f"(anchor, then delta), flush included. Verify+decode: the reader's per-chunk sha256 + "
        f"decode from downloaded bytes, torch threads 1, a pool of 1 or 2 threads over chunks, best of 3 interleaved. "
        f"Apply: `TensorPatch.apply_to` (int16 add at the indices) into a bf16 copy of the "
        f"base, one thread; **bit-exact vs the trainer's new tensors: asserted for every tensor**. "
        f"Staging memory: VmHWM growth over VmRSS after `clear_refs` 5, during the real reader "
        f"path (plan + `iter_patches`, all patches held; pages the allocator reuses are not counted, "
        f"so it can read below the decoded size in parentheses). Machine: {os.cpu_count()} cores shared "
        f"(load {r['load']:.1f} at the end): wall times are upper bounds.",
        "",
        "| codec | step | changed elements | step bytes (B/el) | Hub requests (plan + iter_patches) "
        "| bytes fetched | publish s (diff + encode/upload) | real path s (plan + download + verify "
        "+ decode) | download s | verify+decode s, 1 thread | 2 threads (speed-up) | apply s | "
        "peak staging RSS (decoded patches) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["rows"]:
        lines.append(
            f"| {x['codec']} | {x['step']} | {x['changed']:,} | {_gb(x['step_bytes'])} "
            f"({x['step_bytes'] / x['changed']:.2f}) | {_req(x['requests'])} | {_gb(x['fetched'])} | "
            f"{x['publish_s']:.2f} ({x['diff_s']:.2f} + {x['upload_s']:.2f}) | {x['real_s']:.2f} | "
            f"{x['download_s']:.2f} | {x['decode1_s']:.2f} | {x['decode2_s']:.2f} "
            f"({x['decode1_s'] / x['decode2_s']:.2f}x) | {x['apply_s']:.2f} | "
            f"{_gb(x['staged_peak'])} ({_gb(x['staged_values'])}) |")
    first = r["rows"][0]
    lines += [
        "",
        f"Anchor ({first['codec']}): {_gb(first['anchor_bytes'])} in {first['anchor_s']:.1f} s. "
        f"Tensor generation {r['gen_s']:.1f} s. "
        + (f"Peak RSS of the benchmark: {r['peak_rss'] / 2**30:.2f} GiB." if r["peak_rss"] else ""),
        "",
        layout_table(r),
        "",
        model_section(r),
    ]
    return "\n".join(lines)


def layout_table(r: dict[str, Any]) -> str:
    lo = r["layout"]
    return "\n".join([
        f"#### Requests and manifest when the bucket holds every rank's experts (measured, "
        f"{lo['layers']} layer(s), tensors shrunk {LAYOUT_SHRINK}x per dimension, files "
        f"{LAYOUT_SHRINK ** 2}x smaller)",
        "",
        f"The whole model's MoE delta of those layers ({lo['tensors']:,} tensors: 256 routed experts, "
        f"router, shared expert per layer) is published in {lo['files']} data file(s); EP rank 0 reads "
        f"its experts 0-7, the router and the shared expert with `iter_patches(select=...)` (byte "
        f"ranges per file, adjacent ranges merged; each ranged read is one resolve + CDN GET). The "
        f"manifest lists every tensor and is read whole by every rank.",
        "",
        "| tensors in the step | data files | manifest bytes (every rank reads it) | rank 0: Hub requests "
        "| rank 0: data bytes selected | rank 0: bytes fetched (manifest + data) | plan s (manifest "
        "read + parse + check) | plan + iter_patches s |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
        f"| {lo['tensors']:,} | {lo['files']} | {_gb(lo['manifest_bytes'])} | {_req(lo['requests'])} | "
        f"{_gb(lo['selected'])} | {_gb(lo['fetched'])} | {lo['plan_s']:.2f} | {lo['total_s']:.2f} |",
    ])


def model_section(r: dict[str, Any]) -> str:
    """The deployment model (benchmarks/scale_model.py) from this run's measurements."""
    rows = [x for x in r["rows"] if x["codec"] == r["codecs"][0]]  # the default codec
    changed = rows[-1]["changed"]
    best = {k: min(y[k] for y in rows) for k in ("fetched", "decode1_s", "decode2_s", "apply_s")}
    lo, enc = r["layout"], r["encode"]
    measured = Measured(
        fetched_b=best["fetched"] / changed, step_b=rows[-1]["step_bytes"] / changed,
        decode1_ns=best["decode1_s"] / changed * 1e9, decode_speedup=best["decode1_s"] / best["decode2_s"],
        apply_ns=best["apply_s"] / changed * 1e9, encode1_ns=enc["wall1_s"] / enc["changed"] * 1e9,
        encode_speedup=enc["wall1_s"] / enc["wall2_s"], sha_gbps=enc["sha_gbps"],
        data_requests_per_layer=max(0, sum(lo["requests"].values()) - 2) / lo["layers"],
        plans=r["plans"])
    return render_model(measured)


def run(quick: bool = False) -> str:
    return render(measure(quick))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 layer, 2 routed experts")
    print(run(parser.parse_args().quick))


if __name__ == "__main__":
    main()
