"""Read a bucket written by TRL's delta weight sync and republish it in this format.

TRL's layout (PRs #5417/#5932, never released) has no manifest::

    anchors/step_000010.safetensors   every parameter, full bf16 tensors under their names
    deltas/step_000011.safetensors    {name}.indices (int32 flat) + {name}.values (bf16, absolute)

with header metadata ``format="sparse_weight_patch"``, ``version="1"`` and informative fields
(``sparse``, ``model_version``, ``sparsity``, ``changed_params``). Each delta applies on the
state of the file before it. :class:`TrlImporter` replays the files in step order from the
newest usable anchor and hands each full state to a :class:`~vllm_deltasync.trainer.publisher.DeltaPublisher`,
which diffs it and writes manifests, checksums and chains (and any codec, e.g. ``sparse-v2``).
A TRL user keeps the trainer as it is and runs ``vllm-deltasync import-trl SRC DST --follow``.
"""

from __future__ import annotations

import json
import re
import struct
import threading
from dataclasses import dataclass
from typing import Literal

import torch
from safetensors.torch import load as load_safetensors

from vllm_deltasync._loop import default_loop
from vllm_deltasync.errors import ChainError, FormatError
from vllm_deltasync.stores import open_store
from vllm_deltasync.stores.base import Store
from vllm_deltasync.trainer.publisher import DeltaPublisher

TRL_FORMAT = "sparse_weight_patch"
_NAME = re.compile(r"^(anchors|deltas)/step_(\d+)\.safetensors$")


@dataclass(frozen=True)
class TrlFile:
    """One step file of a TRL bucket."""

    step: int
    kind: Literal["anchor", "delta"]
    path: str


def parse_trl_path(path: str) -> TrlFile | None:
    """``anchors/step_000010.safetensors`` -> TrlFile(10, "anchor", path); None for others."""
    m = _NAME.match(path)
    if m is None:
        return None
    return TrlFile(int(m.group(2)), "anchor" if m.group(1) == "anchors" else "delta", path)


def plan_replay(files: list[TrlFile], after: int | None = None) -> list[TrlFile]:
    """Files to replay, in step order, to reach every step newer than ``after``.

    Starts at the newest anchor at or before the first step wanted (or the first anchor);
    a step with both an anchor and a delta uses the anchor. [] when nothing is newer.
    """
    by_step: dict[int, TrlFile] = {}
    for f in sorted(files, key=lambda f: (f.step, f.kind == "anchor")):
        by_step[f.step] = f  # the anchor wins a tie: sorted after the delta
    ordered = [by_step[s] for s in sorted(by_step)]
    wanted = [f for f in ordered if after is None or f.step > after]
    if not wanted:
        return []
    anchors = [i for i, f in enumerate(ordered) if f.kind == "anchor" and f.step <= wanted[0].step]
    if not anchors:
        later = [i for i, f in enumerate(ordered) if f.kind == "anchor"]
        if not later:
            raise ChainError("TRL bucket: no anchors/step_*.safetensors; a delta chain needs an anchor to start")
        return ordered[later[0]:]
    return ordered[anchors[-1]:]


def read_trl_file(data: bytes, f: TrlFile) -> dict[str, torch.Tensor]:
    """Decode one TRL file: an anchor's full tensors, or a delta's ``.indices``/``.values``."""
    try:
        tensors = load_safetensors(data)
        fmt = _header_metadata(data).get("format")
    except Exception as exc:  # safetensors raises its own error type
        raise FormatError(f"TRL {f.path}: not a safetensors file ({exc})") from exc
    if f.kind == "delta" and fmt != TRL_FORMAT:
        raise FormatError(f"TRL {f.path}: header format is {fmt!r}, expected {TRL_FORMAT!r}")
    return tensors


def _header_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's header."""
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + n]).get("__metadata__")
    return meta if isinstance(meta, dict) else {}


def apply_trl_delta(state: dict[str, torch.Tensor], delta: dict[str, torch.Tensor], f: TrlFile) -> None:
    """Write a TRL delta's absolute values into ``state`` (flat views) in place."""
    names = {k[: -len(".indices")] for k in delta if k.endswith(".indices")}
    for name in sorted(names):
        if name not in state:
            raise FormatError(f"TRL {f.path}: {name!r} is not in the anchor; the bucket mixes models")
        values = delta.get(f"{name}.values")
        indices = delta[f"{name}.indices"]
        if values is None or values.numel() != indices.numel() or values.dtype != state[name].dtype:
            raise FormatError(f"TRL {f.path}: {name!r}: .values missing or not matching .indices")
        flat = state[name].view(-1)
        idx = indices.to(torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= flat.numel()):
            raise FormatError(f"TRL {f.path}: {name!r}: an index is outside [0, {flat.numel()})")
        flat[idx] = values


class TrlImporter:
    """Replays a TRL bucket into a vllm-deltasync bucket through a DeltaPublisher.

    Opened from a URL, the importer owns its source store: :meth:`close` (or leaving a
    ``with`` block) closes it, so ``hf://`` and ``s3://`` sessions are released on the loop
    that opened them (no "Unclosed client session" at exit). A store passed in stays the
    caller's to close.
    """

    def __init__(self, src: str | Store, publisher: DeltaPublisher, *, timeout_s: float = 600.0) -> None:
        self._owns_src = isinstance(src, str)
        self.src = open_store(src) if isinstance(src, str) else src
        self.publisher = publisher
        self.timeout_s = timeout_s
        self._state: dict[str, torch.Tensor] | None = None
        self._state_step: int | None = None

    def close(self) -> None:
        """Close the source store if this importer opened it (idempotent)."""
        if self._owns_src:
            self._owns_src = False
            default_loop().run(self.src.close(), self.timeout_s)

    def __enter__(self) -> TrlImporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def scan(self) -> list[TrlFile]:
        """Every step file in the TRL bucket (other objects are ignored)."""
        infos = default_loop().run(self.src.list(""), self.timeout_s)
        return [f for f in (parse_trl_path(i.path) for i in infos) if f is not None]

    def import_new(self) -> list[int]:
        """Publish every TRL step newer than the destination's newest; returns those steps."""
        after = self.publisher.last_step
        plan = plan_replay(self.scan(), after)
        if after is not None and self._state_step == after:  # the held state is the newest published
            plan = [f for f in plan if f.step > after]
        published = []
        for f in plan:
            self._advance(f)
            if after is None or f.step > after:
                self.publisher.publish(f.step, self._state or {})
                published.append(f.step)
        self.publisher.flush()
        return published

    def _advance(self, f: TrlFile) -> None:
        data = default_loop().run(self.src.read(f.path), self.timeout_s)
        tensors = read_trl_file(data, f)
        if f.kind == "anchor":
            self._state = tensors  # freshly loaded: ours to modify
        elif self._state is None:
            raise ChainError(f"TRL {f.path}: delta without a preceding anchor")
        else:
            apply_trl_delta(self._state, tensors, f)
        self._state_step = f.step

    def follow(self, poll_interval_s: float, stop: threading.Event) -> None:
        """Import new steps every ``poll_interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            self.import_new()
            stop.wait(poll_interval_s)


__all__ = [
    "TRL_FORMAT",
    "TrlFile",
    "TrlImporter",
    "apply_trl_delta",
    "parse_trl_path",
    "plan_replay",
    "read_trl_file",
]
