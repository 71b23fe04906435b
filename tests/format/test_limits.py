"""format/limits.py is the one definition of a valid tensor name, shape and step number: the
reader's validation and the writer refuse exactly the same things, and the writer never
commits a manifest the reader refuses."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_deltasync._loop import default_loop
from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.limits import MAX_STEP, name_problem, shape_problem, shown, step_problem
from vllm_deltasync.format.manifest import Manifest, dump_document, load_document
from vllm_deltasync.format.writer import StepFacts, StepItem, WriteOptions, write_files, write_step
from vllm_deltasync.stores import open_store

TOKEN = "0123456789abcdef"
OPTIONS = WriteOptions("sparse-v3", max_file_bytes=1 << 20, timeout_s=30, run_id=TOKEN, writer=TOKEN)
NAMES = {"": False, "a\x00b": False, "w" * 1025: False, "a\ud800": False, "w" * 1024: True,
         "é/ü.weight": True, "__metadata__": True}
SHAPES: dict[tuple[int, ...], bool] = {(1,) * 9: False, (1 << 21, 1 << 20): False, (1,) * 8: True,
                                        (0,): True, (): True}


def _facts(**changes: Any) -> StepFacts:
    return dataclasses.replace(StepFacts(0, "anchor", None, 0, "sha256:" + "0" * 64, (1, 4)), **changes)


def _committed(tmp_path: Path) -> bytes:
    """A good committed manifest's bytes (one dense tensor 'w' of 4 elements)."""
    store = open_store(f"file://{tmp_path}/good")
    item = StepItem("w", (4,), 4, None, torch.zeros(4, dtype=torch.bfloat16), None)
    m = write_step(store, default_loop(), _facts(resumed_from=3), [item], OPTIONS)
    return m.to_json()


def _reads(data: bytes, edit: Any) -> bool:
    """Whether a reader takes the manifest ``data`` with ``edit(doc)`` applied."""
    doc = load_document(data)
    edit(doc)
    try:
        Manifest.from_json(dump_document(doc), source="edited")
    except FormatError:
        return False
    return True


def _writes(tmp_path: Path, name: str, shape: tuple[int, ...]) -> bool:
    """Whether the writer takes a (dense) item of that name and shape; a refusal writes nothing."""
    store = open_store(f"file://{tmp_path}/w")
    n = 4  # the payload is not looked at before the refusal
    item = StepItem(name, shape, n, None, torch.zeros(n, dtype=torch.bfloat16), None)
    try:
        write_files(store, default_loop(), _facts(), [item], OPTIONS)
    except FormatError:
        assert not any(p.is_file() for p in (tmp_path / "w").rglob("*"))
        return False
    return True


@pytest.mark.parametrize("name", list(NAMES), ids=lambda n: repr(n[:12]))
def test_reader_and_writer_agree_on_tensor_names(name: str, tmp_path: Path) -> None:
    data = _committed(tmp_path)
    assert (name_problem(name) is None) == NAMES[name]
    assert _reads(data, lambda doc: doc["tensors"][0].__setitem__("name", name)) == NAMES[name]
    assert _writes(tmp_path, name, (4,)) == NAMES[name]


@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
def test_reader_and_writer_agree_on_shapes(shape: tuple[int, ...], tmp_path: Path) -> None:
    problem = shape_problem(shape)
    assert (problem is None) == SHAPES[shape]
    if problem is None:  # written, committed, and read back
        n = math.prod(shape)
        item = StepItem("w", shape, n, None, torch.zeros(n, dtype=torch.bfloat16), None)
        m = write_step(open_store(f"file://{tmp_path}/ok"), default_loop(),
                       _facts(totals=(1, n)), [item], OPTIONS)
        assert Manifest.from_json(m.to_json(), source="ok").tensors[0].shape == shape
        return
    assert not _writes(tmp_path, "w", shape)
    doc = load_document(_committed(tmp_path))
    doc["tensors"][0]["shape"] = list(shape)
    with pytest.raises(FormatError, match=re.escape(f"tensor 'w' {problem}")):
        Manifest.from_json(dump_document(doc), source="edited")


@pytest.mark.parametrize(("value", "ok"), [(0, True), (MAX_STEP, True), (MAX_STEP + 1, False),
                                           (10**13, False), (2**70, False), (-1, False)])
def test_reader_and_writer_agree_on_resumed_from(value: int, ok: bool, tmp_path: Path) -> None:
    data = _committed(tmp_path)
    assert (step_problem(value) is None) == ok
    assert _reads(data, lambda doc: doc.__setitem__("resumed_from", value)) == ok
    if ok:
        _facts(resumed_from=value)
    else:
        with pytest.raises(FormatError, match=r"resumed_from = -?\d+ is outside"):
            _facts(resumed_from=value)


def test_steps_outside_twelve_digits_are_refused_on_both_sides(tmp_path: Path) -> None:
    data = _committed(tmp_path)
    assert not _reads(data, lambda doc: doc.update(step=MAX_STEP + 1, anchor_step=MAX_STEP + 1))
    with pytest.raises(FormatError, match="step = 1000000000000 is outside"):
        _facts(step=MAX_STEP + 1, anchor_step=MAX_STEP + 1)
    assert shown(10**5000) == "an integer of thousands of digits" and shown("x" * 50).endswith("...")


def test_a_manifest_the_reader_refuses_is_never_committed(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/b")
    m = Manifest.from_json(_committed(tmp_path), source="good")
    from vllm_deltasync.format.writer import commit_manifest

    for bad in (dataclasses.replace(m, step=1, fingerprint="sha256:xyz"),
                dataclasses.replace(m, step=1, created_at=1e12)):
        with pytest.raises(FormatError, match="not committed.*a reader would refuse it"):
            commit_manifest(store, default_loop(), bad, 30)
    assert not (tmp_path / "b" / "manifests").exists()


def test_a_step_whose_manifest_the_reader_refuses_leaves_no_manifest(tmp_path: Path) -> None:
    """write_step checks the manifest's bytes while the store stages their write (file://: a
    temporary file): a refused manifest is neither committed nor left behind."""
    root = tmp_path / "b"
    store = open_store(f"file://{root}")
    item = StepItem("w", (4,), 4, None, torch.zeros(4, dtype=torch.bfloat16), None)
    with pytest.raises(FormatError, match="not committed.*a reader would refuse it"):
        write_step(store, default_loop(), _facts(fingerprint="sha256:xyz"), [item], OPTIONS)
    assert [p.name for p in root.rglob("*") if "manifests" in p.parts and p.is_file()] == []
    assert len(list((root / "data").rglob("*.safetensors"))) == 1  # its data file was written
