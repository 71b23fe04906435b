"""The checkpoint a rank's target was loaded from: its parameter set (names, shapes, dtypes,
read from safetensors headers only) and its files; which names a rank reports digests for."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from vllm_deltasync.errors import ApplyError
from vllm_deltasync.server.worker.shardmap import ShardMap

ParamSet = dict[str, tuple[tuple[int, ...], str]]
"""Checkpoint name -> (shape, dtype name)."""


def checkpoint_params(model: str) -> ParamSet:
    """Names, shapes and dtypes of the checkpoint vLLM loaded (safetensors headers only)."""
    from safetensors import safe_open

    files = safetensors_files(model)
    if not files:
        raise ApplyError(
            f"no *.safetensors found for model {model!r}; deltasync needs the checkpoint's "
            "parameter set to check the bucket against it (serve a safetensors checkpoint)"
        )
    out: ParamSet = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                sl = f.get_slice(name)
                dtype = str(_ST_DTYPES.get(sl.get_dtype(), sl.get_dtype())).replace("torch.", "")
                out[name] = (tuple(sl.get_shape()), dtype)
    return out


_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool"}


def safetensors_files(model: str) -> list[Path]:
    path = Path(model)
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, local_files_only=True,
                                          allow_patterns=["*.safetensors"]))
        except Exception:  # noqa: BLE001 - not in the local cache: reported by the caller
            return []
    return sorted(path.glob("*.safetensors"))


def digest_names(shardmap: ShardMap, names: Iterable[str] | None) -> list[str]:
    """The checkpoint names this rank reports digests for (``names``, default every one it
    holds), without those its map ignores or covers through another name."""
    chosen = list(names) if names is not None else shardmap.names
    return [n for n in chosen if n not in shardmap.ignored and n not in shardmap.covered_by]


__all__ = ["ParamSet", "checkpoint_params", "digest_names", "safetensors_files"]
