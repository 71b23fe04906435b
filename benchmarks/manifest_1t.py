"""Full-size MoE manifests, and one expert-parallel rank's plan timed on one core.

A model of the DeepSeek-V3 architecture (MLA attention, dense first layers, routed experts of
intermediate 2048 plus one shared expert, hidden 7168): DeepSeek-V3 itself (671B: 61 layers,
3 dense, 256 experts, 45,446 tensors) or the 1T of Kimi-K2's shape (61 layers, 1 dense, 384
experts, 69,975 tensors, 1.03T parameters). Two manifests are written with the package's own
serializer (``dump_document``, format v3: the tensor table deflated) into a ``file://`` bucket:
the anchor (dense chunks of at most ``max_file_bytes / 2`` elements, packed into files of
``max_file_bytes`` in tensor order, as ``write_step`` packs them) and a delta on it in which
every tensor changed 1% (one sparse-v3 chunk per tensor: region, roles, meta and sha256 as the
writer writes them; ``base_id`` the anchor's identity). No data file is written: planning reads
manifests only. Digests are sha256 of made-up bytes (as random as real ones, so the manifests
deflate as real ones do).

EP rank 0 of a rollout server at EP=32 holds ``experts / 32`` routed experts of every MoE
layer and every other tensor (attention, router, shared expert, dense layers, embeddings).
:func:`time_plan` times, from a cold reader (nothing cached), ``await reader.plan(anchor, 1)``
(read the delta's manifest, parse and check it, check the link onto the anchor the rank
holds) plus the rank's chunk selection (``BucketReader.selected_bytes``: the chunks and bytes
``iter_patches`` would read), in a child process pinned to one core: ``rank``, the reader
reading manifests for the rank's tensors (``BucketReader.select``, as the poller does), median
of 5; ``full``, the reader parsing every tensor (what every rank did before), if asked.

    .venv/bin/python -m benchmarks.manifest_1t [--model NAME] [--full N] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import hashlib
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HIDDEN, MOE_INTER, DENSE_INTER = 7168, 2048, 18432
Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 1536, 512, 128, 64, 128
EP = 32
DENSITY = 0.01
MAX_FILE_BYTES = 256 << 20
"""``DeltaPublisher``'s default ``max_file_bytes``."""
DELTA_BYTES_PER_CHANGED = 1.4
"""sparse-v3 bytes per changed element of a 1% step (bench_scale measures 1.33)."""
RUNS = 5


@dataclass(frozen=True)
class Model:
    layers: int
    dense_layers: int
    routed: int
    vocab: int
    heads: int


MODELS = {"DeepSeek-V3 (671B)": Model(61, 3, 256, 129280, 128),
          "1T (Kimi-K2 shape)": Model(61, 1, 384, 163840, 64)}


def model_shapes(model: Model) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``model`` in checkpoint order, name -> shape."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (model.vocab, HIDDEN)}
    for layer in range(model.layers):
        p = f"model.layers.{layer}"
        out.update({
            f"{p}.self_attn.q_a_proj.weight": (Q_LORA, HIDDEN),
            f"{p}.self_attn.q_a_layernorm.weight": (Q_LORA,),
            f"{p}.self_attn.q_b_proj.weight": (model.heads * (NOPE + ROPE), Q_LORA),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": (KV_LORA + ROPE, HIDDEN),
            f"{p}.self_attn.kv_a_layernorm.weight": (KV_LORA,),
            f"{p}.self_attn.kv_b_proj.weight": (model.heads * (NOPE + V_HEAD), KV_LORA),
            f"{p}.self_attn.o_proj.weight": (HIDDEN, model.heads * V_HEAD),
            f"{p}.input_layernorm.weight": (HIDDEN,),
            f"{p}.post_attention_layernorm.weight": (HIDDEN,),
        })
        if layer < model.dense_layers:
            out.update(_mlp(f"{p}.mlp", DENSE_INTER))
            continue
        out[f"{p}.mlp.gate.weight"] = (model.routed, HIDDEN)
        out[f"{p}.mlp.gate.e_score_correction_bias"] = (model.routed,)
        for e in range(model.routed):
            out.update(_mlp(f"{p}.mlp.experts.{e}", MOE_INTER))
        out.update(_mlp(f"{p}.mlp.shared_experts", MOE_INTER))
    out["model.norm.weight"] = (HIDDEN,)
    out["lm_head.weight"] = (model.vocab, HIDDEN)
    return out


def _mlp(prefix: str, inter: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (inter, HIDDEN), f"{prefix}.up_proj.weight": (inter, HIDDEN),
            f"{prefix}.down_proj.weight": (HIDDEN, inter)}


def rank_select(model: Model, rank: int = 0) -> Callable[[str], bool]:
    """EP rank ``rank``'s tensors: its ``routed / EP`` routed experts of every MoE layer and
    every tensor that is not a routed expert (as the rank's shard map selects them)."""
    per = model.routed // EP
    lo, hi = rank * per, (rank + 1) * per

    def select(name: str) -> bool:
        if ".mlp.experts." not in name:
            return True
        return lo <= int(name.split(".mlp.experts.", 1)[1].split(".", 1)[0]) < hi

    return select


def _hex(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class _Packer:
    """Chunks into files of about ``MAX_FILE_BYTES`` in order, as ``write_step`` packs them."""

    def __init__(self) -> None:
        self.sizes, self.used = [0], 256  # a safetensors header's room

    def place(self, nbytes: int) -> tuple[int, int]:
        if self.used > 256 and self.used + nbytes > MAX_FILE_BYTES:
            self.sizes.append(0)
            self.used = 256
        offset = self.used
        self.used += nbytes
        self.sizes[-1] = self.used
        return len(self.sizes) - 1, offset


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _anchor_table(shapes: dict[str, tuple[int, ...]], packer: _Packer) -> list[dict[str, Any]]:
    per_chunk = MAX_FILE_BYTES // 2
    out = []
    for name, shape in shapes.items():
        n, chunks = _numel(shape), []
        for start in range(0, n, per_chunk):
            count = min(per_chunk, n - start)
            key = name if count == n else f"{name}.{start}"
            file, offset = packer.place(2 * count)
            chunks.append({"file": file, "count": count, "region": [start, count],
                           "roles": {"values": {"key": key, "dtype": "BF16", "offset": offset,
                                                "length": 2 * count}},
                           "sha256": _hex(0, name, start), "meta": {}})
        out.append({"name": name, "shape": list(shape), "dtype": "bfloat16", "encoding": "dense",
                    "codec_version": 1, "changed": n, "chunks": chunks})
    return out


def _delta_table(shapes: dict[str, tuple[int, ...]], packer: _Packer) -> list[dict[str, Any]]:
    out = []
    for i, (name, shape) in enumerate(shapes.items()):
        n = _numel(shape)
        changed = max(1, round(n * DENSITY))
        first = (i * 7919) % max(1, n // 200)
        length = max(changed, n - first - (i * 104729) % max(1, n // 300))
        nbytes = max(16, int(changed * DELTA_BYTES_PER_CHANGED))
        file, offset = packer.place(nbytes)
        meta = {"layout": "gaps", "first": 0, "values": "diff", "high_bits": 1,
                "high_escapes": i % 5, "value_escapes": int(changed * 0.87),
                "compression": "zstd" if changed > 16 else "none"}
        out.append({"name": name, "shape": list(shape), "dtype": "bfloat16", "encoding": "sparse-v3",
                    "codec_version": 1, "changed": changed, "chunks": [{
                        "file": file, "count": changed, "region": [first, length],
                        "roles": {"data": {"key": f"{name}.data", "dtype": "U8", "offset": offset,
                                           "length": nbytes}},
                        "sha256": _hex(1, name), "meta": meta}]})
    return out


def write_bucket(root: Path, model: Model) -> dict[str, Any]:
    """Write the anchor (step 0) and the 1% delta (step 1) manifests of ``model`` under ``root``."""
    from vllm_deltasync.format.layout import manifest_path
    from vllm_deltasync.format.manifest import dump_document, fingerprint, manifest_identity

    shapes = model_shapes(model)
    head = {"format": "vllm-deltasync", "schema_version": 3, "requires": "vllm-deltasync>=0.4.0",
            "run_id": _hex("run")[:16], "writer": _hex("writer")[:16]}
    out: dict[str, Any] = {"tensors": len(shapes), "elements": sum(map(_numel, shapes.values()))}
    base_id = None
    gc.disable()  # ~1M dicts and lists that all live until written
    try:
        for step, make in ((0, _anchor_table), (1, _delta_table)):
            packer = _Packer()
            table = make(shapes, packer)
            folder = f"data/{step:012d}-{head['writer']}-{_hex(step)[:16]}"
            doc = {**head, **({"base_id": base_id} if base_id else {}), "step": step,
                   "kind": "delta" if step else "anchor", "base_step": 0 if step else None,
                   "anchor_step": 0, "created_at": 1.8e9 + step,
                   "fingerprint": fingerprint((n, s, "bfloat16") for n, s in shapes.items()),
                   "files": [{"path": f"{folder}/{i:05d}.safetensors", "size": size,
                              "sha256": _hex(step, i)} for i, size in enumerate(packer.sizes)],
                   "tensors": table,
                   "totals": {"tensors": len(shapes), "elements": out["elements"],
                              "changed": sum(t["changed"] for t in table), "bytes": sum(packer.sizes)}}
            data = dump_document(doc)
            base_id = manifest_identity(data)
            path = root / manifest_path(step)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            out[f"{doc['kind']}_bytes"] = len(data)
            out[f"{doc['kind']}_files"] = len(packer.sizes)
    finally:
        gc.enable()
    return out


async def _plan_once(url: str, select: Callable[[str], bool], applied: Any,
                     view: bool) -> tuple[float, float, int, int]:
    from vllm_deltasync.format.reader import BucketReader

    reader = BucketReader.open(url)
    if view:
        reader.select = select  # manifests read for the rank's tensors (format/_selected.py)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        chain = await reader.plan(applied, 1)
        selected = reader.selected_bytes(chain[0], select)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        if [m.step for m in chain] != [1]:
            raise AssertionError(f"planned {[m.step for m in chain]}, expected [1]")
        wanted = sum(1 for t in chain[0].tensors if select(t.name))
        return seconds, cpu, wanted, selected
    finally:
        await reader.close()


async def _anchor(url: str, select: Callable[[str], bool]) -> Any:
    from vllm_deltasync.format.reader import BucketReader

    reader = BucketReader.open(url)
    reader.select = select
    try:
        return await reader.manifest(0)
    finally:
        await reader.close()


def child(root: str, name: str, runs: dict[str, int], profile: bool) -> dict[str, Any]:
    """In the pinned child: ``runs[kind]`` cold plans of EP rank 0 for each kind (``rank``:
    manifests read for its tensors, ``full``: every tensor); optionally one profiled more."""
    url, select = f"file://{root}", rank_select(MODELS[name])
    applied = asyncio.run(_anchor(url, select))  # the step the rank holds (not timed)
    out: dict[str, Any] = {"cpus": sorted(os.sched_getaffinity(0))}
    for kind, n in runs.items():
        results = [asyncio.run(_plan_once(url, select, applied, kind == "rank")) for _ in range(n)]
        out[kind] = {"wall": [r[0] for r in results], "cpu": [r[1] for r in results],
                     "median_s": statistics.median(r[0] for r in results),
                     "median_cpu_s": statistics.median(r[1] for r in results),
                     "rank_tensors": results[0][2], "selected_bytes": results[0][3]}
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            asyncio.run(_plan_once(url, select, applied, kind == "rank"))
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
            out[kind]["profile"] = buf.getvalue()
    return out


def time_plan(root: Path, name: str, runs: dict[str, int], *, profile: bool = False,
              pythonpath: str | None = None) -> dict[str, Any]:
    """:func:`child` in a fresh process pinned to one core (the last one this process may use),
    importing the package from ``pythonpath`` when given (another version, for a before/after)."""
    pin = sorted(os.sched_getaffinity(0))[-1]
    code = (f"import json, os, sys; os.sched_setaffinity(0, {{{pin}}}); "
            "from benchmarks.manifest_1t import child; "
            "print(json.dumps(child(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), "
            f"{profile})))")
    here = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, here, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", code, str(root), name, json.dumps(runs)],
                          capture_output=True, text=True, env=env, cwd=pythonpath or here,
                          check=False, timeout=900)
    if done.returncode:
        raise RuntimeError(f"the plan timing failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(name: str, runs: dict[str, int], *, profile: bool = False) -> dict[str, Any]:
    """Write ``name``'s manifests to a temporary bucket and time EP rank 0's plan there."""
    with tempfile.TemporaryDirectory(prefix="deltasync-manifests-") as tmp:
        t0 = time.perf_counter()
        built = write_bucket(Path(tmp), MODELS[name])
        built["write_s"] = time.perf_counter() - t0
        built["plan"] = time_plan(Path(tmp), name, runs, profile=profile)
    return built


def plan_inputs(name: str, runs: int, full: int) -> dict[str, Any]:
    """What bench_scale's model takes from ``name``'s manifests: sizes, the rank's share, and
    the plan's median seconds (``runs`` with the rank's view, ``full`` parsing every tensor)."""
    model = MODELS[name]
    shapes, select = model_shapes(model), rank_select(model)
    r = measure(name, {"rank": runs, **({"full": full} if full else {})})
    rank, full_r = r["plan"]["rank"], r["plan"].get("full")
    return {"tensors": r["tensors"], "elements": r["elements"], "delta_bytes": r["delta_bytes"],
            "rank_tensors": rank["rank_tensors"], "routed": model.routed,
            "moe_layers": model.layers - model.dense_layers,
            "rank_elements": sum(_numel(s) for n, s in shapes.items() if select(n)),
            "plan_s": rank["median_s"], "plan_cpu_s": rank["median_cpu_s"], "runs": runs,
            "full_s": None if full_r is None else full_r["median_s"], "write_s": r["write_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1T (Kimi-K2 shape)")
    parser.add_argument("--runs", type=int, default=RUNS, help="plans with the rank's view")
    parser.add_argument("--full", type=int, default=0, help="plans parsing every tensor")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one plan each")
    args = parser.parse_args()
    runs = {"rank": args.runs, **({"full": args.full} if args.full else {})}
    r = measure(args.model, runs, profile=args.profile)
    profiles = [r["plan"][k].pop("profile", "") for k in runs]
    print(json.dumps(r, indent=1))
    print("\n".join(profiles))


if __name__ == "__main__":
    main()
