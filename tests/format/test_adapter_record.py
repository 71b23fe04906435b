"""The manifest's optional ``adapter`` record (docs/format.md §4.2) through the writer and both
readers: ``write_step`` with ``StepFacts(adapter=...)`` on formats 2 and 3, the full parser
(``Manifest.from_json``) and the parser of a rank's selected tensors (format/_selected.py),
which keeps every field but the tensor table. No peft needed: the record is plain data."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from vllm_deltasync._loop import default_loop
from vllm_deltasync.errors import ConfigError, FormatError
from vllm_deltasync.format._selected import _table, read_manifest
from vllm_deltasync.format.adapter import AdapterInfo
from vllm_deltasync.format.manifest import Manifest, dump_document, fingerprint, load_document
from vllm_deltasync.format.writer import StepFacts, StepItem, WriteOptions, write_step
from vllm_deltasync.stores import open_store

NAMES = [f"base_model.model.model.layers.{i}.self_attn.{p}_proj.lora_{ab}.weight"
         for i in range(2) for p in ("q", "v") for ab in ("A", "B")]


def _info(**over: Any) -> AdapterInfo:
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": False,
              "target_modules": ["v_proj", "q_proj"], "task_type": "CAUSAL_LM", **over}
    return AdapterInfo.from_config(config, "sha256:" + "c" * 64)


def _write(version: int, adapter: AdapterInfo | None, name: str) -> bytes:
    store = open_store(f"memory://adapter-record-{name}-{version}")
    gen = torch.Generator().manual_seed(0)
    items = [StepItem(n, (4, 16), 64, None, torch.randn(64, generator=gen).to(torch.bfloat16), None)
             for n in NAMES]
    options = WriteOptions("sparse-v3", max_file_bytes=1024, timeout_s=60, version=version,
                           run_id="ab" * 4, writer="cd" * 4)
    fp = fingerprint((n, (4, 16), "bfloat16") for n in NAMES)  # an anchor holds its whole set
    facts = StepFacts(0, "anchor", None, 0, fp, (len(items), 64 * len(items)), adapter=adapter)
    manifest = write_step(store, default_loop(), facts, items, options)
    assert manifest.adapter == adapter
    data: bytes = default_loop().run(store.read(manifest.path), 60)
    return data


@pytest.mark.parametrize("version", [2, 3])
def test_the_record_is_written_and_read_back_by_both_parsers(version: int) -> None:
    info = _info(use_rslora=True)
    data = _write(version, info, "both")
    assert json.loads(data)["adapter"]["scaling"] == 8 / 2
    full = Manifest.from_json(data, source="m")
    assert full.adapter == info and len(full.tensors) == len(NAMES)
    assert (_table(data) is not None) == (version == 3)  # v3: the table is split, not parsed
    view = read_manifest(data, source="m", select=lambda n: ".layers.1." in n)
    assert view.adapter == info and len(view.tensors) == len(NAMES) // 2
    assert view.identity == full.identity


def test_a_defective_record_is_refused_by_the_selecting_reader_too() -> None:
    data = _write(3, _info(), "defect")
    doc = load_document(data)
    doc["adapter"]["rank"] = 8  # disagrees with the config's r and with the scaling
    edited = dump_document(doc)
    assert _table(edited) is not None
    for parse in (lambda: Manifest.from_json(edited, source="edited"),
                  lambda: read_manifest(edited, source="edited", select=lambda n: False)):
        with pytest.raises(FormatError, match="edited: adapter: scaling"):
            parse()


def test_without_a_record_the_bytes_name_no_adapter() -> None:
    data = _write(3, None, "none")
    assert b'"adapter"' not in data and Manifest.from_json(data, source="m").adapter is None


def test_format_1_has_no_record() -> None:
    store = open_store("memory://adapter-record-v1")
    facts = StepFacts(0, "anchor", None, 0, "sha256:" + "0" * 64, (1, 4), adapter=_info())
    item = StepItem("a", (4,), 4, None, torch.zeros(4, dtype=torch.bfloat16), None)
    with pytest.raises(ConfigError, match="format version 1 has no adapter record"):
        write_step(store, default_loop(), facts, [item], WriteOptions("sparse-v2", version=1))
    assert default_loop().run(store.list(""), 60) == []  # refused before anything was written
