"""bench_scale's deployment model: publish -> applied for a DeepSeek-V3-shaped MoE at 1T.

Inputs come in two kinds, kept apart. **Measured** (by bench_scale on this machine): the
rank share's bytes, verify + decode seconds at 1 and 2 threads, CPU apply, and requests per
changed element or layer; the codec's encode at 1 and 2 threads and sha256's rate; the plan
of one EP rank on the full-size manifest, one core (benchmarks/manifest_1t.py), and that
manifest's size. **Assumed** (:data:`ASSUMED`, each with what it stands for): rates of
hardware not here, latencies, cores, scaling beyond what was measured. :func:`sensitivity`
recomputes the total with each assumption halved and doubled. The scenario itself (the
model, 1% changed, the trainer's and the fleet's layout) is :data:`SCENARIO`, not varied.

Time is the sum of the stages (no overlap: an upper bound). The trainer: the diff on the
device, the changed elements to the host, encode + hashing, upload over the node's link
shared by its 8 ranks, the commit's request rounds. A rollout rank (all 8 of a node at once,
sharing the node's link and cores): download over the link plus its requests' round trips,
the plan, verify + decode, apply.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Assumption:
    value: float
    unit: str
    what: str


ASSUMED: dict[str, Assumption] = {
    "device_diff_gbps": Assumption(1000.0, "GB/s", "effective device-memory rate of the trainer's "
                                   "diff on the GPU (4 B read per element; H100/H200 HBM peaks at "
                                   "3.3-4.8 TB/s)"),
    "pcie_gbps": Assumption(25.0, "GB/s", "device <-> host per GPU: the trainer's changed "
                            "elements (12 B each) to the host, the rollout's decoded patches (10 B "
                            "per element) to the device (PCIe 5 x16 peaks at ~55)"),
    "link_gbps": Assumption(100.0, "Gb/s", "a node's link to the bucket, shared by its 8 ranks "
                            "(trainer upload, rollout download)"),
    "request_s": Assumption(0.1, "s", "latency of one bucket request (the commit's rounds; each "
                            "rollout rank's requests, 8 at a time as the reader issues them)"),
    "commit_requests": Assumption(4.0, "rounds", "commit rounds besides the part records: the "
                                  "listing, the existence check, the manifest PUT, its read-back"),
    "encode_beyond_2": Assumption(1.0, "x", "encode speed-up a trainer rank's host cores give over "
                                  "the measured 2-thread rate (1: none; only 1 and 2 threads are "
                                  "measured)"),
    "rollout_cores": Assumption(16.0, "cores", "host cores per rollout node for the 8 ranks' plan "
                                "+ verify + decode (2 per rank: the measured 2-thread speed-up; no "
                                "credit beyond 2)"),
}
"""Every assumed input of the total, by name."""

SCENARIO = {"density": 0.01, "trainer_gpus": 256, "gpus_per_node": 8, "ep": 32, "replicas": 32,
            "part_reads": 32, "read_concurrency": 8}
"""The question asked (1% changed, a 256-GPU trainer, EP=32 serving) and code facts:
trainer/sharded.py reads 32 part records at a time; the reader fetches 8 files at a time."""

OTHER = ("GPU apply: the decoded patches to the device at `pcie_gbps`, the scatter itself "
         "negligible; attention, embeddings, router and the shared expert replicated on every "
         "rollout rank (each rank reads their delta: conservative for bytes); every parameter "
         "element published by exactly one trainer rank; bucket/CDN egress not the bottleneck; "
         "no overlap between stages; requests of discovery not counted (bench_download)")


@dataclass(frozen=True)
class Measured:
    """Per changed element (ns, B), per layer, or per rank; all measured on this machine."""

    fetched_b: float
    """Data bytes fetched per changed element of the rank's share (hf://, ranged reads)."""
    step_b: float
    """Data bytes written per changed element (the codec's size)."""
    decode1_ns: float
    """Verify + decode per changed element, one thread."""
    decode_speedup: float
    """Verify + decode at 2 threads over 1."""
    apply_ns: float
    """The CPU build's apply per changed element, one thread."""
    encode1_ns: float
    """The codec's encode per changed element, one thread."""
    encode_speedup: float
    """Encode at 2 threads over 1."""
    sha_gbps: float
    """sha256 of written bytes, one thread (the writer hashes each chunk and each file)."""
    data_requests_per_layer: float
    """A rank's data requests per MoE layer (hf://: a resolve and a CDN GET per range)."""
    plans: Mapping[str, Mapping[str, Any]]
    """Model -> manifest_1t.measure's result: tensors, elements, rank elements, manifest
    bytes, the plan's median wall seconds on one core."""


def trainer_terms(m: Measured, plan: Mapping[str, Any], a: Mapping[str, float]) -> dict[str, float]:
    """Seconds per stage of one trainer rank's publish (its share: 1/256 of the parameters)."""
    rank_params = plan["elements"] / SCENARIO["trainer_gpus"]
    changed = rank_params * SCENARIO["density"]
    nbytes = changed * m.step_b
    encode = changed * m.encode1_ns * 1e-9 / m.encode_speedup / a["encode_beyond_2"]
    rounds = math.ceil(SCENARIO["trainer_gpus"] / SCENARIO["part_reads"]) + a["commit_requests"]
    return {"changed": changed,
            "diff": rank_params * 4 / (a["device_diff_gbps"] * 1e9),
            "to_host": changed * 12 / (a["pcie_gbps"] * 1e9),
            "encode": encode + 2 * nbytes / (m.sha_gbps * 1e9),
            "upload": nbytes * SCENARIO["gpus_per_node"] / (a["link_gbps"] * 1e9 / 8),
            "commit": rounds * a["request_s"]}


def rollout_terms(m: Measured, plan: Mapping[str, Any], a: Mapping[str, float]) -> dict[str, float]:
    """Seconds per stage of one rollout rank of a node (its 8 ranks at once)."""
    ranks = SCENARIO["gpus_per_node"]
    changed = plan["rank_elements"] * SCENARIO["density"]
    rank_bytes = changed * m.fetched_b + plan["delta_bytes"]
    requests = 2 + m.data_requests_per_layer * plan["moe_layers"]
    cores = a["rollout_cores"] / ranks
    two = max(1.0, m.decode_speedup)  # a second thread never slows the decode (one would do)
    speedup = two if cores >= 2 else max(min(cores, 1.0), 1 + (two - 1) * (cores - 1))
    return {"changed": changed, "rank_bytes": rank_bytes, "requests": requests,
            "download": rank_bytes * ranks / (a["link_gbps"] * 1e9 / 8),
            "round_trips": math.ceil(requests / SCENARIO["read_concurrency"]) * a["request_s"],
            "plan": plan["plan_s"] / min(1.0, cores),
            "decode": changed * m.decode1_ns * 1e-9 / speedup,
            "apply_gpu": changed * 10 / (a["pcie_gbps"] * 1e9),
            "apply_cpu": changed * m.apply_ns * 1e-9}


def totals(m: Measured, plan: Mapping[str, Any], a: Mapping[str, float]) -> tuple[float, float, float]:
    """(trainer publish -> committed, publish -> applied on GPU servers, with the CPU build)."""
    t, r = trainer_terms(m, plan, a), rollout_terms(m, plan, a)
    trainer = t["diff"] + t["to_host"] + t["encode"] + t["upload"] + t["commit"]
    common = trainer + r["download"] + r["round_trips"] + r["plan"] + r["decode"]
    return trainer, common + r["apply_gpu"], common + r["apply_cpu"]


def defaults() -> dict[str, float]:
    return {name: x.value for name, x in ASSUMED.items()}


def sensitivity(m: Measured, plan: Mapping[str, Any]) -> list[tuple[str, float, tuple[float, float], tuple[float, float]]]:
    """Each assumption halved and doubled: (name, value, (GPU, CPU) total at x0.5, at x2)."""
    out = []
    for name, x in ASSUMED.items():
        pair = []
        for factor in (0.5, 2.0):
            a = defaults() | {name: x.value * factor}
            _, gpu, cpu = totals(m, plan, a)
            pair.append((gpu, cpu))
        out.append((name, x.value, pair[0], pair[1]))
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def render(m: Measured, headline_model: str = "1T (Kimi-K2 shape)") -> str:
    """The model's tables: plans measured, trainer, rollout, assumptions with sensitivity."""
    a = defaults()
    lines = [
        "#### Publish -> applied at full size (measured rates and plans; assumed hardware, named below)",
        "",
        f"**Measured on this machine**: {m.step_b:.2f} B written and {m.fetched_b:.2f} B fetched per "
        f"changed element; verify + decode {m.decode1_ns:.1f} ns per changed element on one thread, "
        f"{m.decode_speedup:.2f}x at 2; the codec's encode {m.encode1_ns:.1f} ns per changed element "
        f"on one thread, {m.encode_speedup:.2f}x at 2 (bench_codec's method: tensors spread over a "
        f"pool); sha256 {m.sha_gbps:.2f} GB/s; the CPU build's apply {m.apply_ns:.1f} ns per changed "
        f"element; {m.data_requests_per_layer:.1f} data requests per MoE layer per rank (tables above); "
        "and, on full-size manifests (benchmarks/manifest_1t.py: every tensor of the model, chunk "
        "tables as the writer writes them, anchor + 1% delta, `file://`), EP rank 0's `plan` + "
        "chunk selection, from a cold reader, pinned to one core:",
        "",
        "| model | tensors in the step | delta manifest | rank 0's tensors | rank 0: plan + chunk "
        "selection s, median of runs (CPU s) | runs | the same reader without `select` (every tensor parsed) s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in m.plans.items():
        full = f"{p['full_s']:.2f}" if p.get("full_s") is not None else "not run"
        lines.append(f"| {name} | {p['tensors']:,} | {_gb(p['delta_bytes'])} | {p['rank_tensors']:,} | "
                     f"{p['plan_s']:.2f} ({p['plan_cpu_s']:.2f}) | {p['runs']} | {full} |")
    lines += ["", *_trainer_table(m, a), "", *_rollout_table(m, a), "",
              *_assumption_table(m, headline_model), "", _headline(m, headline_model, a)]
    return "\n".join(lines)


def _trainer_table(m: Measured, a: Mapping[str, float]) -> list[str]:
    lines = ["| model | parameters | trainer: per rank changed | diff on device s | changes to host s "
             "| encode + sha256 s | upload at link s | commit s | **trainer: publish -> committed s** |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in m.plans.items():
        t = trainer_terms(m, p, a)
        trainer = totals(m, p, a)[0]
        lines.append(f"| {name} | {p['elements'] / 1e12:.2f}T | {t['changed'] / 1e6:.1f}M | "
                     f"{t['diff']:.3f} | {t['to_host']:.3f} | {t['encode']:.2f} | {t['upload']:.2f} | "
                     f"{t['commit']:.1f} | **{trainer:.1f}** |")
    return lines


def _rollout_table(m: Measured, a: Mapping[str, float]) -> list[str]:
    lines = ["| model | routed experts / rollout rank / layer | per rank: data + manifest fetched | "
             "per node fetched | download at link s | requests per rank (round trips s) | plan s "
             "(measured) | verify+decode s | apply s: GPU (CPU build) | **publish -> applied s: GPU "
             "(CPU build)** |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in m.plans.items():
        r = rollout_terms(m, p, a)
        _, gpu, cpu = totals(m, p, a)
        lines.append(
            f"| {name} | {p['routed'] // SCENARIO['ep']} (+1 shared) | {_gb(r['rank_bytes'])} "
            f"({_gb(p['delta_bytes'])} manifest) | {_gb(r['rank_bytes'] * SCENARIO['gpus_per_node'])} | "
            f"{r['download']:.2f} | {r['requests']:.0f} ({r['round_trips']:.1f}) | {r['plan']:.2f} | "
            f"{r['decode']:.2f} | {r['apply_gpu']:.2f} ({r['apply_cpu']:.1f}) | **{gpu:.1f}** ({cpu:.1f}) |")
    return lines


def _assumption_table(m: Measured, model: str) -> list[str]:
    p = m.plans[model]
    lines = [f"**Assumed** (every input not measured; the total for {model}, each halved and doubled):",
             "",
             "| assumption | value | what it stands for | publish -> applied, x0.5: GPU (CPU build) "
             "| x2: GPU (CPU build) |",
             "|---|---:|---|---:|---:|"]
    for name, value, half, double in sensitivity(m, p):
        x = ASSUMED[name]
        lines.append(f"| `{name}` | {value:g} {x.unit} | {x.what} | {half[0]:.1f} ({half[1]:.1f}) | "
                     f"{double[0]:.1f} ({double[1]:.1f}) |")
    sc = SCENARIO
    lines += ["", f"Scenario (not varied): {sc['density']:.0%} of the elements changed per step; the "
              f"trainer on {sc['trainer_gpus']} GPUs ({sc['trainer_gpus'] // sc['gpus_per_node']} "
              f"nodes of {sc['gpus_per_node']}, expert parallel x FSDP, the sharded publisher: 1/"
              f"{sc['trainer_gpus']} of the parameters per rank); served at EP={sc['ep']}, "
              f"{sc['replicas']} replicas, a node = {sc['gpus_per_node']} ranks. Code facts: the "
              f"committer reads {sc['part_reads']} part records at a time, the reader {sc['read_concurrency']} "
              f"files at a time. Also assumed: {OTHER}."]
    return lines


def _headline(m: Measured, model: str, a: Mapping[str, float]) -> str:
    p = m.plans[model]
    trainer, gpu, cpu = totals(m, p, a)
    t, r = trainer_terms(m, p, a), rollout_terms(m, p, a)
    sc = SCENARIO
    return (f"**1T MoE, 1% changed, trained on {sc['trainer_gpus']} GPUs, served at EP={sc['ep']}: "
            f"{gpu:.1f} s publish -> applied on GPU servers ({cpu:.1f} s with the CPU build's apply): "
            f"the trainer's part {trainer:.1f} s ({t['commit']:.1f} s of it the commit's request "
            f"rounds, {t['encode']:.2f} s encode + sha256 at the measured 2-thread rate), the rollout "
            f"rank's {gpu - trainer:.1f} s (download {r['download']:.2f} s + {r['round_trips']:.1f} s "
            f"of request round trips, plan {r['plan']:.2f} s measured on one core, verify + decode "
            f"{r['decode']:.2f} s at the measured 2-thread rate). Assumed rates and latencies: table "
            "above.**")


__all__ = ["ASSUMED", "OTHER", "SCENARIO", "Assumption", "Measured", "defaults", "render",
           "rollout_terms", "sensitivity", "totals", "trainer_terms"]
