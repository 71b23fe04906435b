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
bucket server (``tests/stores/hubserver.py``, run in its own process, loopback, no bandwidth
limit; it counts the requests). Each delta step changes 1% of every tensor's elements at
uniformly random positions; the bf16 bit-pattern difference (int16, new - old) has
|d| = 1 (70%), 2 (20%), 3 (4%), 4 (4%), 5..16 uniform (2%), sign +/- at random.

Measured per rank (= per node here) for a delta step: Hub requests (at the server), bytes
fetched, publish seconds, download seconds, verify + decode seconds with 1 and 2 threads
(torch intra-op threads 1; the thread pool decodes independent chunks), apply seconds (in-place
``TensorPatch.apply_to`` scatter into a bf16 copy of the base, one thread), bit-exactness
against the trainer's new tensors (asserted), and peak staging memory (growth of VmHWM over
VmRSS after resetting VmHWM through ``/proc/self/clear_refs``, over the real reader path that
holds every decoded patch of the step). Then extrapolated, and labelled so: per-element rates
measured here (per core) are scaled to 58 / 60 MoE layers (DeepSeek-V3, a Kimi-K2-shaped 1T),
to a stated trainer (1T on 256 GPUs, expert parallel x FSDP, the sharded publisher) and to a
rollout fleet (EP=32 replicas of 8-GPU nodes); every assumed rate is a named constant below.

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

from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.codecs import get_codec
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.stores import open_store
from vllm_deltasync.trainer.publisher import DeltaPublisher

HUBSERVER = Path(__file__).resolve().parents[1] / "tests" / "stores" / "hubserver.py"
BUCKET = "bench/scale"
HIDDEN, INTER = 7168, 2048
ROUTED, EP = 256, 32
DENSITY = 0.01
# |d| distribution of the bf16 bit-pattern differences (measured RL steps: mostly 1-2 ulps)
MAGNITUDES = [1, 2, 3, 4, *range(5, 17)]
PROBS = [0.70, 0.20, 0.04, 0.04, *([0.02 / 12] * 12)]

# extrapolation assumptions
MOE_LAYERS = {"DeepSeek-V3 (671B)": (58, 256), "1T (Kimi-K2 shape)": (60, 384)}
"""name -> (MoE layers, routed experts); hidden 7168, expert intermediate 2048, 1 shared."""
GPUS_PER_NODE = 8
REPLICAS = 32
LINK_GBPS = 100.0
"""Assumed per-node front-end (storage/Internet) link, Gb/s, shared by the node's 8 ranks."""
DECODE_CORES = 16
"""Assumed host cores per node given to verify + decode (2 per GPU)."""

# the trainer's layout (assumed): 1T trained on 256 GPUs, 32 nodes of 8
TRAINER_GPUS = 256
"""Expert parallel across nodes x FSDP within: every parameter element is held, for the
sharded publisher, by exactly one rank (a replicated copy publishes from one rank only)."""
TRAINER_ENCODE_CORES = 8
"""Host cores per trainer GPU given to the publisher's encode pool (trainer hosts have
~100-200 cores per 8 GPUs)."""
DEVICE_DIFF_GBPS = 1000.0
"""Assumed effective device-memory rate of the diff on the GPU (compare + gather + baseline
update, 4 bytes read per element: new and baseline bf16); H100/H200 HBM peaks at 3.3-4.8 TB/s.
Not measured: no GPU here (benchmarks/gpu.py measures it where one is)."""
PCIE_GBPS = 25.0
"""Assumed device-to-host (trainer: changed elements) and host-to-device (rollout: decoded
patches) rate per GPU, GB/s (PCIe 5 x16 peaks at ~55)."""
REQUEST_S = 0.1
"""Assumed latency of one bucket request (HEAD/GET/PUT of a small object)."""
COMMIT_REQUESTS = 4
"""Rounds of requests on the commit path besides the part records: the listing that finds
them, the commit's existence check, the manifest PUT, its read-back."""
PART_READS = 32
"""Part records the committing rank reads at once (trainer/sharded.py PART_READS)."""

_SERVER = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("deltasync_scale_hubserver", sys.argv[1])
mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
with mod.HubServer() as hub:
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
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(HUBSERVER)],
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
                "diff_threads": pub._differ.threads, "encode_threads": _encode_threads(pub),
                "codec": codec, "step": k, "anchor_s": anchor_s, "anchor_bytes": anchor_bytes,
                "changed": changed, "elements": sum(t.numel() for t in tensors.values()),
                "publish_s": publish_s, "diff_s": diff_s, "upload_s": upload_s,
                "step_bytes": manifest.totals.bytes, "data_files": len(manifest.files),
                "requests": seen["counts"], "fetched": seen["cdn_bytes"],
                "real_s": real["seconds"], "download_s": download_s,
                "download_requests": fetched["counts"], "download_bytes": fetched["cdn_bytes"],
                "decode1_s": decoded[1], "decode2_s": decoded[2], "apply_s": apply_s,
                "staged_peak": staged_peak, "staged_values": staged_values,
            })
    server.command(f"drop {bucket}")
    return rows


def _encode_threads(pub: DeltaPublisher) -> int:
    """Threads the publisher encodes a step's chunks on (1 before the writer had a pool)."""
    chosen = getattr(pub, "encode_threads", None)
    if chosen is None:
        return 1
    return int(chosen) or min(8, len(os.sched_getaffinity(0)))


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
            rows += measure_codec(server, codec, tensors, deltas=(1 if quick or i else 2), seed=100 * i)
        del tensors
        gc.collect()
        layout = measure_layout(server, layers, codecs[0])
    finally:
        server.close()
    return {"layers": layers, "experts": experts, "share_bytes": share, "tensors": n_tensors,
            "layout": layout,
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
        extrapolate(r),
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


def extrapolate(r: dict[str, Any]) -> str:
    layers, experts, lo = r["layers"], r["experts"], r["layout"]
    units = layers * (experts + 1)
    rows = [x for x in r["rows"] if x["codec"] == r["codecs"][0]]
    x = rows[-1]  # the default codec; times: best of its delta steps (the cores are shared)
    per_unit = {k: min(y[k] for y in rows) / units for k in ("fetched", "decode1_s", "apply_s")}
    # measured per-core rates, conservative: a pool's seconds times its threads (no credit for
    # scaling that a shared 2-core machine does not show)
    diff_ns = min(y["diff_s"] * y["diff_threads"] / y["elements"] for y in r["rows"]) * 1e9
    encode_ns = min(y["upload_s"] * y["encode_threads"] / y["changed"] for y in rows) * 1e9
    b_per_el = x["step_bytes"] / x["changed"]
    manifest_req = 2  # resolve + CDN GET, whatever its size
    data_req_per_layer = max(0, sum(lo["requests"].values()) - manifest_req) / lo["layers"]
    manifest_per_tensor = lo["manifest_bytes"] / lo["tensors"]
    plan_per_tensor = lo["plan_s"] / lo["tensors"]
    fleet_nodes = REPLICAS * EP // GPUS_PER_NODE
    trainer_nodes = TRAINER_GPUS // GPUS_PER_NODE
    link = LINK_GBPS * 1e9 / 8
    lines = [
        f"#### Extrapolation (not measured: per-element rates measured above, scaled to the "
        f"layouts below; {x['codec']})",
        "",
        "**Measured on this machine** (best delta step; a pool's seconds times its threads, so "
        "per core and conservative): "
        f"the publisher's host diff {diff_ns:.2f} ns per parameter element per core; encode + "
        f"write {encode_ns:.1f} ns per changed element per core; {b_per_el:.2f} B per changed "
        f"element; verify + decode {per_unit['decode1_s'] / max(1.0, x['changed'] / units) * 1e9:.1f} "
        f"ns per changed element per core; the rollout's CPU apply "
        f"{per_unit['apply_s'] / max(1.0, x['changed'] / units) * 1e9:.1f} ns per changed element; "
        "fetched bytes, requests and the manifest's size per layer and tensor (tables above).",
        "",
        f"**Assumed trainer** (issue 27's layout): the model trained on {TRAINER_GPUS} GPUs "
        f"({trainer_nodes} nodes of {GPUS_PER_NODE}), expert parallel x FSDP, every parameter "
        f"element published by exactly one rank (the sharded publisher, DTensors): "
        f"1/{TRAINER_GPUS} of the parameters per rank, 1% of them changed. Diff on the device "
        f"(`previous_on=\"device\"`) at {DEVICE_DIFF_GBPS:.0f} GB/s effective over 4 B per "
        f"element, the changed elements (12 B each: int64 index, new and old bf16) to the host "
        f"at {PCIE_GBPS:.0f} GB/s; the host-path column instead copies every parameter to the "
        f"host at that rate and diffs at the measured per-core rate on {TRAINER_ENCODE_CORES} "
        f"cores; encode on {TRAINER_ENCODE_CORES} host cores per GPU at the measured per-core "
        f"rate; upload: the node's 8 ranks' bytes over its {LINK_GBPS:.0f} Gb/s link; commit: "
        f"rank 0 reads the {TRAINER_GPUS} part records {PART_READS} at a time plus "
        f"{COMMIT_REQUESTS} more request rounds, {REQUEST_S * 1e3:.0f} ms each.",
        "",
        f"**Assumed rollout fleet** (as before): EP={EP} replicas, a node = {GPUS_PER_NODE} GPUs "
        f"= {GPUS_PER_NODE} EP ranks each fetching and decoding its own share (the shared "
        f"expert's delta and the manifest fetched 8x per node; 'with the node cache': "
        f"`NodeCachedStore` fetches them once), node link {LINK_GBPS:.0f} Gb/s, {DECODE_CORES} "
        f"host cores per node for verify + decode at the measured per-core rate; apply: the "
        f"measured single-thread CPU scatter per rank (the CPU build), or, on GPUs (assumed), the "
        f"decoded patches (10 B per element) to the device at {PCIE_GBPS:.0f} GB/s with the "
        f"scatter itself negligible; fleet = {REPLICAS} replicas = {fleet_nodes} nodes; "
        "bucket/CDN egress not the bottleneck; no overlap between stages (an upper bound: "
        "the reader downloads, decodes and applies file by file). Not included: attention, "
        "embeddings, dense layers (~2% of the parameters), discovery requests (bench_download).",
        "",
        "| model | parameters (MoE) | trainer: per rank changed | diff on device s (host path s) "
        "| changes to host s | encode s | upload at link s | commit s | **trainer: publish -> "
        "committed s** |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rollout = [
        "",
        "| model | routed experts / rollout rank / layer | per rank: data + manifest fetched | "
        "per node fetched (with the node cache) | download at link s | plan + verify+decode s "
        "(per node) | apply s: GPU (CPU build) | **publish -> applied s: GPU (CPU build)** | Hub "
        "requests / step: rank / fleet | fleet bytes / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    headline = ""
    for model, (moe_layers, routed) in MOE_LAYERS.items():
        params = moe_layers * (routed + 1) * 3 * HIDDEN * INTER
        rank_changed = params / TRAINER_GPUS * DENSITY
        device_diff = params / TRAINER_GPUS * 4 / (DEVICE_DIFF_GBPS * 1e9)
        host_diff = (params / TRAINER_GPUS * 2 / (PCIE_GBPS * 1e9)
                     + params / TRAINER_GPUS * diff_ns * 1e-9 / TRAINER_ENCODE_CORES)
        to_host = rank_changed * 12 / (PCIE_GBPS * 1e9)
        encode = rank_changed * encode_ns * 1e-9 / TRAINER_ENCODE_CORES
        upload = rank_changed * b_per_el * GPUS_PER_NODE / link
        commit = (-(-TRAINER_GPUS // PART_READS) + COMMIT_REQUESTS) * REQUEST_S
        trainer = device_diff + to_host + encode + upload + commit
        lines.append(
            f"| {model} | {params / 1e12:.2f}T | {rank_changed / 1e6:.1f}M | {device_diff:.3f} "
            f"({host_diff:.1f}) | {to_host:.3f} | {encode:.2f} | {upload:.2f} | {commit:.1f} | "
            f"**{trainer:.1f}** |")

        per_rank_experts = routed // EP
        u = moe_layers * (per_rank_experts + 1)
        moe_tensors = moe_layers * (routed * 3 + 4)
        manifest = manifest_per_tensor * moe_tensors
        rank_bytes = per_unit["fetched"] * u + manifest
        node_bytes = rank_bytes * GPUS_PER_NODE
        cached = per_unit["fetched"] * moe_layers * (per_rank_experts * GPUS_PER_NODE + 1) + manifest
        download = node_bytes / link
        decode = (plan_per_tensor * moe_tensors * GPUS_PER_NODE
                  + per_unit["decode1_s"] * u * GPUS_PER_NODE) / DECODE_CORES
        rank_applied = per_unit["apply_s"] * u
        changed_rank = x["changed"] / units * u
        gpu_apply = changed_rank * 10 / (PCIE_GBPS * 1e9)
        total_gpu = trainer + download + decode + gpu_apply
        total_cpu = trainer + download + decode + rank_applied
        req_rank = manifest_req + data_req_per_layer * moe_layers
        rollout.append(
            f"| {model} | {per_rank_experts} (+1 shared) | {_gb(rank_bytes)} ({_gb(manifest)} "
            f"manifest) | {_gb(node_bytes)} ({_gb(cached)}) | {download:.2f} | {decode:.1f} | "
            f"{gpu_apply:.2f} ({rank_applied:.1f}) | **{total_gpu:.1f}** ({total_cpu:.1f}) | "
            f"{req_rank:.0f} / {req_rank * REPLICAS * EP:,.0f} | {_gb(node_bytes * fleet_nodes)} |")
        if model.startswith("1T"):
            headline = (
                f"**1T MoE, 1% changed, trained on {TRAINER_GPUS} GPUs, served at EP={EP}: "
                f"{total_gpu:.1f} s publish -> applied on GPU servers ({total_cpu:.1f} s with the "
                f"CPU build's apply), extrapolated: the trainer's part {trainer:.1f} s (of which "
                f"{commit:.1f} s the commit's assumed request latency, {encode:.2f} s encode at the "
                f"measured per-core rate on {TRAINER_ENCODE_CORES} cores per GPU), the rollout "
                f"node's {download + decode + gpu_apply:.1f} s (verify + decode {decode:.1f} s on "
                f"{DECODE_CORES} cores). Before 0.5 the same model said 252 s: it diffed and "
                f"encoded 31B parameters per trainer rank on one CPU thread.**")
    lines += rollout + ["", headline]
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    return render(measure(quick))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 layer, 2 routed experts")
    print(run(parser.parse_args().quick))


if __name__ == "__main__":
    main()
