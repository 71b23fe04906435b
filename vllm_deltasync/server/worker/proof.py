"""The startup proof: before a rank follows a bucket, show its shard map matches what the
kernels compute from, for every parameter class. Run on the worker's main thread at start
(and again after a reload behind our back), before the poller starts and before any write.

Two checks per parameter class (a class is a runtime parameter name with the layer numbers
taken out: ``model.layers.#.self_attn.qkv_proj.weight``, ``...experts.w13_weight``, ...):

1. **The map reads what the kernel reads.** Every element of every checkpoint tensor this rank
   holds is read back through the map (learned layouts followed) and compared bit for bit with
   the checkpoint loaded from disk. A kernel that rearranged a parameter after loading, with no
   learned layout for it, fails here (for any checkpoint whose values are not all equal).
   Learned layouts are checked with *coded* values when they are learned (``layouts.py``: two
   codings of every position must agree), so they do not rely on the checkpoint's values;
   parameters whose values are all equal (zero biases, all-ones norms) are counted as
   ``uninformative`` in the report: for them check 2 is the evidence.
2. **A write through the map changes what the model computes.** For each class and each rank in
   turn, a sample of the class's elements is set through the map (absolute values, an undo
   recorded), a tiny forward runs on a fixed input, its output must differ from the baseline;
   then the undo puts the elements back bit for bit and the output must equal the baseline
   again. A kernel computing from a hidden copy fails here. The forward is a collective on
   every rank, so every rank runs the same rounds.

A class that fails is never written: the rank refuses to follow (:class:`ProofFailed`, naming
the parameter and the reason). This module imports no vLLM; the forward is a callable from
``server/vllm/worker.py``.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_deltasync.errors import ApplyError
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.server.worker.shardmap import Piece, ShardMap, Target

Forward = Callable[[], torch.Tensor]
Refresh = Callable[[Iterable[torch.Tensor]], Any]


def _no_refresh(params: Iterable[torch.Tensor]) -> None:
    return None

SAMPLE = 65536
"""Elements set per class and rank in check 2 (spread evenly over what the rank holds)."""


class ProofFailed(ApplyError):
    """The startup proof failed for a parameter class: the rank must not follow."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"startup proof failed for {param}: {reason}")
        self.param = param
        self.reason = reason


def param_class(param_name: str) -> str:
    """The class of a runtime parameter: its name with layer (and expert) numbers as ``#``."""
    return re.sub(r"\.\d+(?=\.|$)", ".#", param_name)


@dataclass
class ProofReport:
    classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    layouts: list[str] = field(default_factory=list)
    failures: list[ProofFailed] = field(default_factory=list)

    def fail(self, param: str, reason: str) -> None:
        """Record a failure; the checks go on so every rank runs the same collective rounds."""
        self.failures.append(ProofFailed(param, reason))

    def raise_first(self) -> None:
        if self.failures:
            raise self.failures[0]

    def to_dict(self) -> dict[str, Any]:
        return {"classes": self.classes, "seconds": round(self.seconds, 3),
                "layouts": self.layouts, "failures": [str(f) for f in self.failures]}


def _targets(shardmap: ShardMap, name: str) -> list[Target]:
    if name in shardmap.ignored or name in shardmap.covered_by:
        return []
    return sorted(shardmap.targets(name), key=lambda t: t.block.src_offset)


def check_values(shardmap: ShardMap, files: Iterable[Path], report: ProofReport) -> None:
    """Check 1: every held checkpoint element read through the map equals the checkpoint's."""
    from safetensors import safe_open

    from vllm_deltasync.server.worker.apply import live_values

    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name not in shardmap._shapes:
                    continue
                targets = _targets(shardmap, name)
                if not targets:
                    continue
                full = f.get_tensor(name).contiguous().reshape(-1)
                for t, live in zip(targets, live_values(targets), strict=True):
                    b = t.block
                    want = full.as_strided(b.sizes, b.src_strides, b.src_offset)
                    want = want.to(t.param.dtype).reshape(-1)
                    got = live.reshape(-1).to("cpu")
                    entry = report.classes.setdefault(param_class(t.param_name), _entry(t))
                    entry["elements"] += int(want.numel())
                    if want.numel() > 1 and bool((want != want[0]).any()):
                        entry["informative"] = True
                    same = _bits(got) == _bits(want)
                    if not bool(same.all()) and not report.failures:
                        bad = int((~same).sum())
                        report.fail(
                            t.param_name,
                            f"{bad} of {want.numel()} elements of checkpoint tensor {name!r} "
                            "read through the shard map differ from the loaded checkpoint (the "
                            "kernel keeps this parameter in a layout the map does not follow)")


def list_classes(shardmap: ShardMap, report: ProofReport, *, values_check: str) -> None:
    """Enter every parameter class this rank holds in ``report`` without check 1 (after a
    reload: ``values_check`` says why it was not run)."""
    for name in shardmap.names:
        for t in _targets(shardmap, name):
            entry = report.classes.setdefault(param_class(t.param_name),
                                              {**_entry(t), "values_check": values_check})
            entry["elements"] += math.prod(t.block.sizes)


def _bits(t: torch.Tensor) -> torch.Tensor:
    size = t.element_size()
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return t.contiguous().view(view)


def _entry(t: Target) -> dict[str, Any]:
    return {"param": t.param_name, "elements": 0, "informative": False,
            "layout": t.layout.describe() if t.layout is not None else "as loaded",
            "write_check": "not run"}


def class_names(shardmap: ShardMap) -> list[str]:
    """The parameter classes this rank holds (the engine core unites them over the ranks)."""
    return sorted(_class_names(shardmap))


def check_writes(shardmap: ShardMap, forward: Forward, report: ProofReport, *, rank: int,
                 world: int, classes: Iterable[str] | None = None,
                 refresh: Refresh | None = None) -> None:
    """Check 2 (collective: every rank runs the same rounds, see the module docstring).

    ``classes`` must be the same list on every rank (the union over ranks); a class this
    rank does not hold is a round where it writes nothing. ``refresh`` is what a switch runs
    after writing (packed CPU kernels: pack the written layers again, ``packed.py``); it runs
    here after every write and every put-back, so the proof covers it."""
    refresh = refresh or _no_refresh
    from vllm_deltasync.server.worker.apply import Undo, apply_patches

    base = forward()
    if not torch.equal(forward(), base):
        report.fail("the probe forward", "two runs on the same input differ")
        return
    by_class = _class_names(shardmap)
    for cls in sorted(by_class) if classes is None else list(classes):
        names, param = by_class.get(cls, ([], cls))
        for turn in range(world):
            undo = Undo()
            pieces = (_sample_pieces(shardmap, names, param)
                      if turn == rank and names and not report.failures else [])
            try:
                apply_patches(pieces, undo)
                refresh(p.param for p in pieces)
                out = forward()
            finally:
                undo.revert()
                refresh(p.param for p in pieces)
            after = forward()
            if not torch.equal(after, base):
                report.fail(param, "putting the probe elements back did not give the "
                                  "model's outputs back bit for bit")
            changed = not torch.equal(out, base)
            # the control round runs on every rank in every round (it is a collective)
            control = _control_changes(shardmap, param, forward, base, refresh,
                                       mine=turn == rank and bool(pieces) and not changed)
            observable = changed or control
            if turn == rank and cls in report.classes:
                report.classes[cls]["write_check"] = (
                    "changed outputs" if changed else
                    "missed" if observable else "not observable by the probe forward")
                if pieces and observable and not changed:
                    report.fail(
                        param, "writes through the shard map do not change what the model "
                        "computes (the kernel computes from a copy the map does not reach)")


def _control_changes(shardmap: ShardMap, param: str, forward: Forward, base: torch.Tensor,
                     refresh: Refresh, *, mine: bool) -> bool:
    """A control round (collective; only the rank in turn writes, and only after its write
    through the map had no effect): negate the whole live parameter directly, run the
    forward, put it back bit for bit. True when that changed the output: the probe forward
    observes this parameter, so the map's writes missed the elements the kernel reads."""
    live = None
    for targets in (shardmap.targets(n) for n in shardmap.names if n not in shardmap.ignored):
        for t in targets:
            if t.param_name == param:
                live = t.param
                break
        if live is not None:
            break
    saved = live.detach().clone() if mine and live is not None else None
    try:
        if saved is not None and live is not None:
            live.data.neg_().add_(0.5)
            refresh([live])
        out = forward()
    finally:
        if saved is not None and live is not None:
            live.data.copy_(saved)
            refresh([live])
    return saved is not None and not torch.equal(out, base)


def _class_names(shardmap: ShardMap) -> dict[str, tuple[list[str], str]]:
    """Per class: the checkpoint names writing its first parameter, and that parameter."""
    firsts: dict[str, str] = {}
    names: dict[str, list[str]] = {}
    for name in shardmap.names:
        for t in _targets(shardmap, name):
            cls = param_class(t.param_name)
            first = firsts.setdefault(cls, t.param_name)
            if t.param_name == first and name not in names.setdefault(cls, []):
                names[cls].append(name)
    return {cls: (names[cls], firsts[cls]) for cls in firsts}


def _sample_pieces(shardmap: ShardMap, names: list[str], param: str) -> list[Piece]:
    """Absolute pieces setting a spread sample of ``param``'s elements through the map."""
    from vllm_deltasync.server.worker.apply import prepare

    pieces: list[Piece] = []
    per_name = max(1, SAMPLE // max(1, len(names)))
    for name in names:
        targets = [t for t in _targets(shardmap, name) if t.param_name == param]
        src = torch.cat([t.block.src_indices() for t in targets]).unique()
        step = max(1, src.numel() // per_name)
        idx = src[::step].contiguous()
        dtype = targets[0].param.dtype
        values = torch.full((idx.numel(),), 0.5, dtype=dtype)
        values[1::2] = -0.25
        patch = TensorPatch(name=name, shape=shardmap.shape(name), indices=idx, values=values)
        pieces.extend(p for p in shardmap.translate(patch) if p.param is targets[0].param)
    return prepare(pieces)


def prove(shardmap: ShardMap, files: Iterable[Path], forward: Forward | None, *, rank: int,
          world: int, layouts: Iterable[str] = ()) -> ProofReport:
    """Run both checks; raises :class:`ProofFailed` naming the first failing parameter (after
    every collective round ran, so the other ranks never wait for this one)."""
    started = time.perf_counter()
    report = ProofReport(layouts=list(layouts))
    with torch.no_grad():
        check_values(shardmap, files, report)
        if forward is not None:
            check_writes(shardmap, forward, report, rank=rank, world=world)
    report.seconds = time.perf_counter() - started
    report.raise_first()
    return report


__all__ = ["SAMPLE", "Forward", "ProofFailed", "ProofReport", "check_values", "check_writes",
           "class_names", "list_classes", "param_class", "prove"]
