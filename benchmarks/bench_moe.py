"""Per-expert cost: shard map build (with learned CPU MoE layouts) and one step's apply.

Real MoE checkpoints hold 10^4-10^5 expert tensors. Here vLLM's own ``Qwen3MoeForCausalLM``
is built for one rank (TP=1, in this process, no engine: a single-process gloo world as in
tests/helpers/tp_world.py) with 64 layers of 160 experts, hidden 128, expert intermediate 64,
and vLLM's own after-load processing runs on it (the CPU MoE kernel pads and repacks
``w13_weight`` / ``w2_weight``). The checkpoint has per-expert tensors, as ``save_pretrained``
writes them: ``gate_proj`` and ``up_proj`` [64, 128] and ``down_proj`` [128, 64], so
64 x 160 x 3 = 30,720 expert tensors (the issue's 20,480 = 64 x 160 x 2 tensors of [64, 128]
are the gate and up projections; the down projections come on top). Measured:

* **map build**: what a rank does at start before its proof: learn the layouts
  (``LayoutCache``, one per kernel and shape) and probe every checkpoint name through the
  model's ``load_weights`` (``ShardMap.from_model``); the same code as ``TargetRank._build_map``.
* **step**: a relative delta changing 1% of every expert tensor's elements (random positions,
  a few bf16 ulps), once for the issue's 20,480 tensors of [64, 128] (gate and up) and once
  for all 30,720. *Staging* (poller thread, off the pause): translate to runtime indices
  through the learned layouts, merge per parameter, prepare. *Apply* (the engine's pause):
  ``apply_patches`` with an ``Undo``, as ``RankSwitch.apply`` does.
* **layout memory**: bytes of the learned layouts (and of the shard map's blocks) vs the
  expert weights' bytes.

    .venv/bin/python -m benchmarks.bench_moe [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LAYERS, EXPERTS, HIDDEN, INTER = 64, 160, 128, 64
DENSITY = 0.01


def _world(tmp: Path, layers: int) -> Any:
    """vLLM config of the model and a started single-process parallel state."""
    import transformers
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=EXPERTS, num_experts_per_tok=8,
        moe_intermediate_size=INTER, intermediate_size=256, decoder_sparse_step=1,
        max_position_embeddings=512, torch_dtype="bfloat16")
    cfg.save_pretrained(tmp / "model")
    # a valid extension config, as an engine's: the CPU GEMM patch acts only then (it read the
    # environment a section run before left; alone, this section built stock packed linears)
    os.environ.setdefault("VLLM_DELTASYNC_URL", f"file://{tmp / 'bucket'}")
    os.environ["VLLM_DELTASYNC_CPU_KERNELS"] = "inplace"
    mc = ModelConfig(model=str(tmp / "model"), dtype="bfloat16", skip_tokenizer_init=True,
                     enforce_eager=True)
    vc = VllmConfig(model_config=mc)
    # as in an engine with the extension: the CPU GEMM patch keeps 2-D linear weights
    vc.parallel_config.worker_extension_cls = "vllm_deltasync.DeltaSyncExtension"
    from vllm_deltasync.server.vllm.cpu_gemm import patch as _patch_cpu_gemm

    _patch_cpu_gemm()
    with set_current_vllm_config(vc):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"file://{tmp / 'dist_init'}")
        parallel_state.initialize_model_parallel(1, 1)
    return vc


def _build(vc: Any) -> torch.nn.Module:
    """The model for one rank, loaded with zeros' worth of nothing (``torch.empty``), then
    vLLM's own after-load processing (the CPU MoE pad + repack)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(vc):
            model = Qwen3MoeForCausalLM(vllm_config=vc)
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, 0.02)
            process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    finally:
        torch.set_default_dtype(saved)
    return model


def _checkpoint_params(layers: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names and shapes of the checkpoint (per-expert tensors), as safetensors headers say."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=EXPERTS, num_experts_per_tok=8,
        moe_intermediate_size=INTER, decoder_sparse_step=1, torch_dtype="bfloat16")
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, t in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):  # fused in memory, per expert on disk
            prefix = name.removesuffix("gate_up_proj")
            for e in range(EXPERTS):
                out[f"{prefix}{e}.gate_proj.weight"] = ((INTER, HIDDEN), "bfloat16")
                out[f"{prefix}{e}.up_proj.weight"] = ((INTER, HIDDEN), "bfloat16")
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(EXPERTS):
                out[f"{prefix}{e}.down_proj.weight"] = ((HIDDEN, INTER), "bfloat16")
        else:
            out[name] = (tuple(t.shape), "bfloat16")
    return out


def _delta(params: dict[str, tuple[tuple[int, ...], str]], density: float) -> list[Any]:
    from vllm_deltasync.format.codec import TensorPatch

    gen = torch.Generator().manual_seed(0)
    patches = []
    for name, (shape, _) in params.items():
        if ".experts." not in name:
            continue
        n = shape[0] * shape[1]
        k = max(1, int(n * density))
        idx = torch.randperm(n, generator=gen)[:k].sort().values
        diff = torch.randint(-3, 4, (k,), generator=gen, dtype=torch.int16)
        patches.append(TensorPatch(name, shape, idx, diff, relative=True))
    return patches


def measure(layers: int = LAYERS) -> dict[str, Any]:
    from vllm_deltasync.server.vllm.loaders import LOADER
    from vllm_deltasync.server.vllm.worker import layout_specs as _layout_specs
    from vllm_deltasync.server.worker.apply import Undo, apply_patches, merge_pieces, prepare
    from vllm_deltasync.server.worker.layouts import LayoutCache
    from vllm_deltasync.server.worker.shardmap import ShardMap, translate_all

    tmp = Path(tempfile.mkdtemp(prefix="bench-moe"))
    vc = _world(tmp, layers)
    try:
        t0 = time.perf_counter()
        model = _build(vc)
        build_model_s = time.perf_counter() - t0
        params = _checkpoint_params(layers)
        live = dict(model.named_parameters())
        expert_bytes = sum(p.numel() * p.element_size() for n, p in live.items()
                           if n.endswith(("w13_weight", "w2_weight")))
        expert_tensors = sum(1 for n in params if ".experts." in n)

        load = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        cache = LayoutCache()
        specs = {}
        for name, spec in _layout_specs(model).items():
            if not cache.learn(spec, live[name]).identity:
                specs[name] = spec
        learn_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        shardmap = ShardMap.from_model(model, params, specs, loader=LOADER)
        probe_s = time.perf_counter() - t1
        build_s = time.perf_counter() - t0
        build_cpu_s = time.process_time() - c0

        patches = _delta(params, DENSITY)
        issue = [p for p in patches if not p.name.endswith("down_proj.weight")]
        cases = {}
        for case, chosen in (("issue", issue), ("all", patches)):
            t0 = time.perf_counter()
            translated = translate_all(shardmap, chosen)
            translate_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            pieces = prepare(merge_pieces(translated))
            merge_s = time.perf_counter() - t0
            applies = []
            for _ in range(7):
                undo = Undo()
                t0 = time.perf_counter()
                written = apply_patches(pieces, undo)
                applies.append(time.perf_counter() - t0)
                undo.revert()
            cases[case] = {"tensors": len(chosen), "changed": written,
                           "pieces": len(translated), "merged_pieces": len(pieces),
                           "translate_s": translate_s, "merge_s": merge_s,
                           "apply_s": sorted(applies)[3]}
        unmerged = prepare(translated)
        undo = Undo()
        t0 = time.perf_counter()
        apply_patches(unmerged, undo)
        cases["all"]["apply_unmerged_s"] = time.perf_counter() - t0
        undo.revert()
        blocks = sum(len(shardmap.targets(n)) for n in shardmap.names)
        return {
            "layers": layers, "expert_tensors": expert_tensors, "expert_bytes": expert_bytes,
            "layouts": sorted(lay.describe() for lay in cache.layouts.values()),
            "layout_bytes": cache.nbytes, "blocks": blocks, "names": len(shardmap.names),
            "build_model_s": build_model_s, "learn_s": learn_s, "probe_s": probe_s,
            "build_s": build_s, "build_cpu_s": build_cpu_s, "cases": cases,
            "threads": torch.get_num_threads(), "load": load,
        }
    finally:
        from vllm.distributed import parallel_state

        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
        gc.collect()


def run(quick: bool = False) -> str:
    r = measure(8 if quick else LAYERS)
    issue, full = r["cases"]["issue"], r["cases"]["all"]

    def verdict(value: float, limit: float) -> str:
        return "meets" if value <= limit else "**misses**"

    share = r["layout_bytes"] / r["expert_bytes"]
    lines = [
        f"### Per-expert cost (vLLM `Qwen3MoeForCausalLM`, one rank, TP=1, CPU MoE kernel; "
        f"{r['layers']} layers x {EXPERTS} experts, hidden {HIDDEN}, expert intermediate {INTER})",
        "",
        f"The model class is built in this process (no engine) and vLLM's after-load processing "
        f"runs on it (CPU MoE pad + repack), as in a worker. Checkpoint: {r['expert_tensors']:,} "
        f"expert tensors (gate/up [64, 128], down [128, 64]), {r['names']:,} names in all; "
        f"expert weights {r['expert_bytes'] / 2**20:.0f} MiB. Deltas: relative, "
        f"{DENSITY:.0%} of the elements of every tensor they touch, applied with an undo as "
        f"`RankSwitch.apply` does. Torch threads {r['threads']}; load average at start "
        f"{r['load']:.1f} on this shared machine (other engines running: wall times are upper "
        "bounds).",
        "",
        "| what | measured | target |",
        "|---|---|---|",
        f"| shard map build at start: learn layouts + probe all {r['names']:,} names | "
        f"{r['build_s']:.2f} s wall, {r['build_cpu_s']:.2f} s CPU (learn {r['learn_s']:.2f} s, "
        f"probe {r['probe_s']:.2f} s) | <= 5 s: {verdict(r['build_s'], 5)} |",
        f"| apply in the pause, the issue's case: {issue['tensors']:,} tensors of [64, 128] "
        f"({issue['changed']:,} elements, {issue['merged_pieces']} merged pieces) | "
        f"{issue['apply_s'] * 1e3:.1f} ms | <= 50 ms: {verdict(issue['apply_s'], 0.05)} |",
        f"| apply in the pause, every expert tensor ({full['tensors']:,} tensors, "
        f"{full['changed']:,} elements, {full['merged_pieces']} merged pieces) | "
        f"{full['apply_s'] * 1e3:.1f} ms | |",
        f"| the same without merging ({full['pieces']:,} pieces, one scatter per tensor) | "
        f"{full['apply_unmerged_s'] * 1e3:.0f} ms | |",
        f"| staging off the pause (poller thread), issue's case / all: translate through the "
        f"layouts | {issue['translate_s']:.2f} s / {full['translate_s']:.2f} s | |",
        f"| staging off the pause, issue's case / all: merge + prepare | "
        f"{issue['merge_s'] * 1e3:.0f} ms / {full['merge_s'] * 1e3:.0f} ms | |",
        f"| learned layout memory | {r['layout_bytes']:,} bytes = {share:.4%} of the expert "
        f"weights | <= 5%: {verdict(share, 0.05)} |",
        f"| shard map blocks (a few integers each, no per-element tables) | {r['blocks']:,} | |",
        "",
        "Layouts learned: " + "; ".join(f"`{d}`" for d in r["layouts"]) + ".",
        f"Not counted: building the model class and vLLM's after-load processing "
        f"({r['build_model_s']:.1f} s, vLLM's own start-up).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))


if __name__ == "__main__":
    main()
