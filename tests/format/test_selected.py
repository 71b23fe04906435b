"""A manifest read for the tensors one reader selects (format/_selected.py): the same tensors,
checks and identity as the full parser gives for them, on real buckets and on hostile tables."""

from __future__ import annotations

import base64
import dataclasses
import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.publishing import Trainer, publish_run
from vllm_deltasync.errors import FormatError, UnsupportedFormatError
from vllm_deltasync.format._selected import _table, read_manifest, split_table
from vllm_deltasync.format.manifest import (
    TABLE_KEY,
    Manifest,
    dump_document,
    fingerprint,
    load_document,
)
from vllm_deltasync.format.reader import BucketReader

SHAPES = {f"model.layers.{i}.mlp.experts.{e}.{p}.weight": (8, 16)
          for i in range(2) for e in range(4) for p in ("gate_proj", "down_proj")}
SHAPES |= {"model.embed_tokens.weight": (40, 16), "model.norm.weight": (16,), "lm_head.weight": (40, 16)}


def _rank(rank: int) -> Callable[[str], bool]:
    """Experts 2 * rank and 2 * rank + 1 of every layer, and every other tensor."""
    return lambda n: ".experts." not in n or int(n.split(".experts.")[1].split(".")[0]) // 2 == rank


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    root = tmp_path_factory.mktemp("selected") / "bucket"
    truth = publish_run(f"file://{root}", range(3), Trainer(seed=3, lr=3e-6, shapes=SHAPES),
                        anchor_every=10, max_file_bytes=1024, codec="sparse-v3")
    return root, truth


def _raw(root: Path, step: int) -> bytes:
    return (root / "manifests" / f"{step:012d}.json").read_bytes()


def _expected(full: Manifest, select: Callable[[str], bool]) -> Manifest:
    return dataclasses.replace(full, tensors=tuple(t for t in full.tensors if select(t.name)),
                               files=tuple(dataclasses.replace(f, index=None) for f in full.files))


@pytest.mark.parametrize("select", [_rank(0), _rank(1), lambda n: True, lambda n: False,
                                    lambda n: n == "model.norm.weight"])
def test_a_view_is_the_full_manifest_reduced_to_the_selected_tensors(
        bucket: tuple[Path, dict[int, Any]], select: Callable[[str], bool]) -> None:
    root, _ = bucket
    for step in range(3):
        data = _raw(root, step)
        assert _table(data) is not None  # the table was split, not parsed in full
        full = read_manifest(data, source="m")
        view = read_manifest(data, source="m", select=select)
        assert view == _expected(full, select) and view.identity == full.identity
        assert full.files[0].index  # the full parse lists each file's index; a view none


def test_a_rank_rebuilds_its_tensors_from_views_reading_only_their_chunks(
        bucket: tuple[Path, dict[int, Any]], run: Any) -> None:
    root, truth = bucket
    select = _rank(1)

    async def go() -> tuple[dict[str, torch.Tensor], int, int]:
        async with BucketReader.open(f"file://{root}") as full, BucketReader.open(f"file://{root}") as reader:
            reader.select = select
            chain = await reader.plan(None, 2)
            assert [m.step for m in chain] == [0, 1, 2]
            state = {e.name: torch.empty(e.numel, dtype=torch.bfloat16) for e in chain[0].tensors}
            for m in chain:
                async for patch in reader.iter_patches(m, select=select):
                    patch.apply_to(state[patch.name])
            m2 = await full.manifest(2)
            return state, reader.selected_bytes(chain[-1], select), full.selected_bytes(m2, select)

    state, view_bytes, full_bytes = run(go())
    want = {n: t for n, t in truth[2].items() if select(n)}
    assert state.keys() == want.keys() and 0 < len(want) < len(SHAPES)
    for name, tensor in want.items():
        assert torch.equal(state[name].view(torch.int16), tensor.reshape(-1).view(torch.int16)), name
    assert 0 < view_bytes <= full_bytes  # ranges of its chunks; never another rank's bytes


def _edit(data: bytes, change: Callable[[dict[str, Any]], None], *, compact: bool = True) -> bytes:
    doc = load_document(data)
    change(doc)
    if compact:
        return dump_document(doc)
    out = {k: v for k, v in doc.items() if k != "tensors"}  # the table with spaces: another layout
    out["files"] = [{k: v for k, v in f.items() if k != "index"} for f in doc["files"]]
    out[TABLE_KEY] = base64.b64encode(zlib.compress(json.dumps(doc["tensors"]).encode())).decode()
    return json.dumps(out).encode()


def _tensor(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in doc["tensors"] if t["name"] == name)


def test_another_layout_of_the_table_is_read_by_the_full_parser(bucket: tuple[Path, dict[int, Any]]) -> None:
    root, _ = bucket
    select = _rank(0)
    for change in (lambda d: None, lambda d: d["tensors"][0].update(shape=d["tensors"][0].pop("shape"))):
        data = _edit(_raw(root, 1), change, compact=False)
        assert _table(data) is None
        assert read_manifest(data, source="m", select=select) == _expected(read_manifest(data, source="m"), select)


def test_a_defect_in_a_selected_tensor_is_refused(bucket: tuple[Path, dict[int, Any]]) -> None:
    root, _ = bucket
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # rank 1's

    def far(doc: dict[str, Any]) -> None:
        _tensor(doc, name)["chunks"][0]["region"] = [0, 10**6]

    def overlap(doc: dict[str, Any]) -> None:
        t = _tensor(doc, name)
        t["chunks"].append(t["chunks"][0])
        doc["totals"]["changed"] += t["changed"]
        t["changed"] *= 2

    for change, says in ((far, "past its 128 elements"), (overlap, "two chunks cover element")):
        data = _edit(_raw(root, 1), change)
        with pytest.raises(FormatError, match=says):
            read_manifest(data, source="m", select=_rank(1))
        with pytest.raises(FormatError, match=says):
            read_manifest(data, source="m")
        view = read_manifest(data, source="m", select=_rank(0))  # not rank 0's: rank 1 refuses it
        assert name not in {t.name for t in view.tensors} and view.tensors


@pytest.mark.parametrize("change, error, says", [
    (lambda d: d["tensors"].append(dict(d["tensors"][-1])), FormatError, "listed twice"),
    (lambda d: d["totals"].update(changed=d["totals"]["changed"] + 1), FormatError, "totals.changed"),
    (lambda d: _tensor(d, "model.layers.1.mlp.experts.3.gate_proj.weight").update(encoding="sparse-v9"),
     UnsupportedFormatError, "unknown to this reader"),
    (lambda d: _tensor(d, "model.layers.1.mlp.experts.3.gate_proj.weight").update(codec_version=7),
     UnsupportedFormatError, "version 7"),
    (lambda d: _tensor(d, "model.layers.1.mlp.experts.3.gate_proj.weight").update(changed=10**6),
     FormatError, "changed 1000000 >"),
    (lambda d: _tensor(d, "model.layers.1.mlp.experts.3.gate_proj.weight").update(dtype="float16"),
     FormatError, "is not 'bfloat16'"),
    (lambda d: _tensor(d, "model.layers.1.mlp.experts.3.gate_proj.weight").update(shape=[8, 0]),
     FormatError, "past its 0 elements"),
    (lambda d: _tensor(d, "model.layers.1.mlp.experts.3.gate_proj.weight").update(name=""),
     FormatError, "empty name"),
])
def test_the_step_wide_rules_hold_over_every_tensor_in_a_view(
        bucket: tuple[Path, dict[int, Any]], change: Callable[[dict[str, Any]], None],
        error: type[Exception], says: str) -> None:
    """Rank 0 does not read rank 1's expert 3, yet a step whose table breaks a step-wide rule
    there (or a tensor field every rank can check) is refused by rank 0 too."""
    root, _ = bucket
    data = _edit(_raw(root, 1), change)
    with pytest.raises(error, match=says):
        read_manifest(data, source="m", select=_rank(0))


def test_an_anchor_view_checks_the_whole_tensor_set_against_the_fingerprint(
        bucket: tuple[Path, dict[int, Any]]) -> None:
    root, _ = bucket

    def rename(doc: dict[str, Any]) -> None:
        _tensor(doc, "model.layers.1.mlp.experts.3.gate_proj.weight")["name"] = "x.weight"

    def drop(doc: dict[str, Any]) -> None:
        doc["totals"]["changed"] -= _tensor(doc, "lm_head.weight")["changed"]
        doc["tensors"] = [t for t in doc["tensors"] if t["name"] != "lm_head.weight"]

    for change, says in ((rename, "fingerprint"), (drop, "a tensor is missing")):
        with pytest.raises(FormatError, match=says):
            read_manifest(_edit(_raw(root, 0), change), source="m", select=_rank(0))


NAMES = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(st.lists(NAMES, min_size=1, max_size=6, unique=True), st.sampled_from([True, False]))
def test_names_with_quotes_brackets_and_escapes_split_and_read_exactly(
        names: list[str], ascii_only: bool) -> None:
    """Table elements with any names (quotes, backslashes, brackets, non-ASCII, control
    characters) and metas holding the same: the split gives json's elements, a view json's
    tensors."""
    tensors = [{"name": n, "shape": [2], "dtype": "bfloat16", "encoding": "dense", "codec_version": 1,
                "changed": 2, "chunks": [{"file": 0, "count": 2, "region": [0, 2],
                                          "roles": {"values": {"key": n, "dtype": "BF16",
                                                               "offset": 8 + 4 * i, "length": 4}},
                                          "sha256": "0" * 64, "meta": {"k": "]}" + n + '\\"['}}]}
               for i, n in enumerate(names)]
    text = json.dumps(tensors, separators=(",", ":"), ensure_ascii=ascii_only).encode()
    spans = split_table(text)
    assert spans is not None
    assert [json.loads(text[s: e + 1]) for s, e in zip(*spans, strict=True)] == tensors
    doc = {"format": "vllm-deltasync", "schema_version": 3, "requires": "vllm-deltasync>=0.4.0",
           "run_id": "ab" * 8, "writer": "cd" * 8, "step": 0, "kind": "anchor", "base_step": None,
           "anchor_step": 0, "created_at": 1.0, "fingerprint": "sha256:" + "0" * 64,
           "files": [{"path": "data/f", "size": 8 + 4 * len(names), "sha256": "1" * 64}],
           "tensors": tensors, "totals": {"tensors": len(names), "elements": 2 * len(names),
                                          "changed": 2 * len(names), "bytes": 8 + 4 * len(names)}}
    doc["fingerprint"] = fingerprint((n, [2], "bfloat16") for n in names)
    data = dump_document(doc)
    assert _table(data) is not None
    pick = set(names[::2]).__contains__
    assert read_manifest(data, source="m", select=pick) == _expected(read_manifest(data, source="m"), pick)
    doc["fingerprint"] = "sha256:" + "0" * 64
    data = dump_document(doc)
    with pytest.raises(FormatError, match="fingerprint") as full:
        read_manifest(data, source="m")
    with pytest.raises(FormatError, match="fingerprint") as view:  # every name was read
        read_manifest(data, source="m", select=pick)
    assert str(view.value) == str(full.value)


E = b'{"s":[1],"c":[{"d":"]}"}]}'
"""A table element of the usual shape: two container fields, the last an array."""


@pytest.mark.parametrize("text", [b"[" + E, b'[{"s":[1],"c":["]}]', b"[" + E + E + b"]",
                                  b"[" + E + b",[1]]", b"[" + E + b", " + E + b"]",
                                  b'[{"s":[1},"c":[2]]}]', E, b"[1]", b'[{"s":[1],"c":[2],"x":3}]',
                                  b'[{"s":[1],"c":[2],"x":[3]}]', b'[{"s":[1],"c":{}}]'])
def test_split_refuses_what_is_not_a_compact_table(text: bytes) -> None:
    assert split_table(text) is None


def test_split_finds_the_elements_of_a_compact_table() -> None:
    text = b"[" + E + b"," + E + b"]"
    spans = split_table(text)
    assert spans is not None
    assert [text[s: e + 1] for s, e in zip(*spans, strict=True)] == [E, E]
    assert split_table(b"[]") is not None
