"""Adapter buckets: the manifest's ``adapter`` record, and a step rebuilt as a PEFT directory.

A trainer publishing with ``DeltaPublisher(url, lora="adapter")`` writes only a LoRA adapter:
its tensors under the names PEFT's ``save_pretrained`` gives them in
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``), and on every
manifest an ``adapter`` record (docs/format.md §4.2): the adapter's rank, alpha, scaling,
target modules, the fingerprint of the base checkpoint it applies onto, and PEFT's own
``adapter_config.json``. A step of such a bucket is rebuilt as a directory PEFT (and vLLM's
``LoRARequest``) loads::

    step = materialize_adapter("file:///data/adapter-bucket", "/tmp/adapter")
    model = PeftModel.from_pretrained(base_model, "/tmp/adapter")

Nothing here imports peft: the directory is two files whose layout PEFT defines.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_deltasync.errors import ChainError, FormatError

CONFIG_NAME = "adapter_config.json"
"""PEFT's adapter configuration file."""
WEIGHTS_NAME = "adapter_model.safetensors"
"""PEFT's adapter weights file."""
_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")
_MAX_CONFIG_BYTES = 1 << 20


def lora_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """The factor PEFT multiplies ``B @ A`` by: ``alpha / rank``, or ``alpha / sqrt(rank)``
    with rsLoRA (the same expressions PEFT evaluates, so the same float)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter bucket's manifest says about its adapter (the ``adapter`` field).

    ``rank``, ``alpha``, ``use_rslora`` and ``target_modules`` are the values of ``config``,
    repeated for readers that do not parse PEFT's configuration; the parser checks they agree.
    Per-module ranks and alphas (``rank_pattern``, ``alpha_pattern``) are in ``config`` and in
    the tensors' shapes.
    """

    rank: int
    """``r``: the default rank of the adapter's layers."""
    alpha: float
    """``lora_alpha``."""
    use_rslora: bool
    """rsLoRA: the scaling is ``alpha / sqrt(rank)`` instead of ``alpha / rank``."""
    scaling: float
    """The default layers' factor on ``B @ A`` (:func:`lora_scaling`)."""
    target_modules: tuple[str, ...] | str
    """The modules the adapter wraps, as configured: names, or one regular expression."""
    base_fingerprint: str
    """The fingerprint (docs/format.md §8) of the base checkpoint's parameter set: the model
    the adapter applies onto, as a merged-weights bucket of it would carry."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """PEFT's ``adapter_config.json`` object, as ``save_pretrained`` writes it."""
    peft_type: str = "LORA"
    """The PEFT method (only ``"LORA"`` is published)."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], base_fingerprint: str) -> AdapterInfo:
        """The record of an ``adapter_config.json`` object; FormatError when it is no LoRA
        configuration."""
        return cls.from_dict({"peft_type": config.get("peft_type"), "rank": config.get("r"),
                              "alpha": config.get("lora_alpha"),
                              "use_rslora": bool(config.get("use_rslora", False)),
                              "scaling": _scaling_of(config), "target_modules": config.get("target_modules"),
                              "base_fingerprint": base_fingerprint, "config": dict(config)})

    def to_dict(self) -> dict[str, Any]:
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return {"peft_type": self.peft_type, "rank": self.rank, "alpha": self.alpha,
                "use_rslora": self.use_rslora, "scaling": self.scaling, "target_modules": targets,
                "base_fingerprint": self.base_fingerprint, "config": dict(self.config)}

    @classmethod
    def from_dict(cls, doc: Any) -> AdapterInfo:
        """Parse and check the record; FormatError naming the field on any defect."""
        if not isinstance(doc, dict):
            raise FormatError("field 'adapter' must be an object")
        if doc.get("peft_type") != "LORA":
            raise FormatError(f"adapter: peft_type {doc.get('peft_type')!r} is not 'LORA' (the "
                              "only adapter this release publishes and reads)")
        rank, alpha, rslora = doc.get("rank"), doc.get("alpha"), doc.get("use_rslora")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise FormatError(f"adapter: rank must be an integer >= 1, got {str(rank)[:40]}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise FormatError(f"adapter: alpha must be a finite number, got {str(alpha)[:40]}")
        if not isinstance(rslora, bool):
            raise FormatError(f"adapter: use_rslora must be true or false, got {str(rslora)[:40]}")
        if doc.get("scaling") != lora_scaling(alpha, rank, rslora):
            raise FormatError(f"adapter: scaling {str(doc.get('scaling'))[:40]} is not "
                              f"{'alpha / sqrt(rank)' if rslora else 'alpha / rank'} "
                              f"({lora_scaling(alpha, rank, rslora)})")
        targets = _targets(doc.get("target_modules"))
        fp = doc.get("base_fingerprint")
        if not isinstance(fp, str) or not _FINGERPRINT.fullmatch(fp):
            raise FormatError(f"adapter: base_fingerprint {str(fp)[:80]!r} is not 'sha256:<64 hex>'")
        config = doc.get("config")
        if not isinstance(config, dict):
            raise FormatError("adapter: config must be an object (adapter_config.json)")
        info = cls(rank, alpha, rslora, lora_scaling(alpha, rank, rslora), targets, fp, config)
        _check_agrees(info, config)
        return info


def _scaling_of(config: Mapping[str, Any]) -> Any:
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, int) and rank >= 1 and isinstance(alpha, (int, float)):
        return lora_scaling(alpha, rank, bool(config.get("use_rslora", False)))
    return None  # from_dict names the bad field


def _targets(raw: Any) -> tuple[str, ...] | str:
    if isinstance(raw, str) and raw:
        return raw
    if isinstance(raw, list) and raw and all(isinstance(t, str) and t for t in raw):
        return tuple(sorted(raw))
    raise FormatError(f"adapter: target_modules must be a non-empty list of module names or a "
                      f"regular expression, got {str(raw)[:80]}")


def _check_agrees(info: AdapterInfo, config: Mapping[str, Any]) -> None:
    """The repeated fields must be those of ``config`` (a reader may use either)."""
    for key, value in (("peft_type", info.peft_type), ("r", info.rank), ("lora_alpha", info.alpha),
                       ("use_rslora", info.use_rslora)):
        have = config.get(key, False if key == "use_rslora" else None)
        if have != value or isinstance(have, bool) != isinstance(value, bool):
            raise FormatError(f"adapter: config {key}={str(have)[:40]} disagrees with the record's "
                              f"{str(value)[:40]}")
    if _targets(config.get("target_modules")) != info.target_modules:
        raise FormatError("adapter: config target_modules disagrees with the record's")


def config_json(info: AdapterInfo) -> bytes:
    """``adapter_config.json`` as PEFT's ``save_pretrained`` writes it (indented, sorted keys)."""
    return json.dumps(dict(info.config), indent=2, sort_keys=True).encode("utf-8")


async def read_adapter(reader: Any, step: int | None = None) -> tuple[int, AdapterInfo, dict[str, Any]]:
    """``(step, adapter record, tensors)`` of ``step`` (newest if None) of an adapter bucket,
    every tensor rebuilt from its anchor and deltas and verified (``BucketReader.read_full``).
    FormatError when the step carries no adapter record (a merged-weights or plain bucket)."""
    if step is None:
        step = await reader.latest_step()
        if step is None:
            raise ChainError(f"{reader.store.url} holds no committed step")
    manifest = await reader.manifest(step)
    if manifest.adapter is None:
        raise FormatError(f"step {step} of {reader.store.url} carries no adapter record: it is "
                          "not an adapter bucket (DeltaPublisher(url, lora='adapter')); "
                          "materialize its full weights instead (vllm-deltasync materialize)")
    tensors = await reader.read_full(step)
    return step, manifest.adapter, tensors


def write_peft_dir(out_dir: str | os.PathLike[str], info: AdapterInfo,
                   tensors: Mapping[str, Any], *, step: int | None = None) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir`` (each
    through a temporary file and a rename). Returns the directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"}  # what PEFT writes; the step is kept apart (PEFT reads only this)
    if step is not None:
        meta["vllm_deltasync_step"] = str(step)
    for name, write in ((WEIGHTS_NAME, lambda p: save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(p), metadata=meta)),
            (CONFIG_NAME, lambda p: p.write_bytes(config_json(info)))):
        target = out / name
        tmp = target.with_name(f".{name}.tmp-{os.getpid()}")
        try:
            write(tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return out


def materialize_adapter(url: str, out_dir: str | os.PathLike[str], *, step: int | None = None,
                        store_options: Mapping[str, Any] | None = None) -> int:
    """Rebuild ``step`` (newest if None) of the adapter bucket at ``url`` as a PEFT directory in
    ``out_dir``; returns the step. The tensors are the published bf16 values: those
    ``save_pretrained`` writes at that step, rounded to bf16 (equal when the adapter trains in
    bf16). Not from inside a running event loop (use :func:`read_adapter` there)."""
    from vllm_deltasync.format.reader import BucketReader  # the reader imports the manifest

    async def go() -> tuple[int, AdapterInfo, dict[str, Any]]:
        async with BucketReader.open(url, store_options=store_options) as reader:
            return await read_adapter(reader, step)

    done, info, tensors = asyncio.run(go())
    write_peft_dir(out_dir, info, tensors, step=done)
    return done


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "AdapterInfo", "config_json", "lora_scaling",
           "materialize_adapter", "read_adapter", "write_peft_dir"]
