"""``verify`` reports a delta naming a tensor its chain's anchor does not have, or has with
another shape (issue 23, item 6): one line naming the step and the tensor, exit 1."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.helpers.faults import write_doc
from tests.helpers.publishing import Trainer, publish_run
from vllm_deltasync import BucketReader
from vllm_deltasync.cli import main
from vllm_deltasync.format.manifest import load_document

NAME = "lm_head.weight"  # (96, 32) in the test model


def _edit_delta(root: Path, step: int, *, rename: str | None = None,
                shape: list[int] | None = None) -> None:
    path = root / "manifests" / f"{step:012d}.json"
    doc = load_document(path.read_bytes())
    (entry,) = [t for t in doc["tensors"] if t["name"] == NAME]
    if rename is not None:
        entry["name"] = rename
        for f in doc["files"]:
            if NAME in f.get("index", {}):
                f["index"][rename] = f["index"].pop(NAME)
    if shape is not None:
        entry["shape"] = shape
    write_doc(root, step, json.dumps(doc).encode())  # step 3 names the edited bytes as its base


@pytest.mark.parametrize(("edit", "line"), [
    ({"rename": "ghost.weight"},
     "step 2: tensor 'ghost.weight' is not in its anchor step 0; the delta cannot be applied"),
    ({"shape": [32, 96]},
     "step 2: tensor 'lm_head.weight' is [32, 96], in its anchor step 0 [96, 32]; the delta "
     "cannot be applied"),
])
def test_verify_reports_a_delta_tensor_its_anchor_lacks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: dict, line: str) -> None:
    root, url = tmp_path / "b", f"file://{tmp_path}/b"
    publish_run(url, range(4), Trainer(seed=1, lr=3e-5), anchor_every=10, format_version=2)
    _edit_delta(root, 2, **edit)

    async def go() -> list[str]:
        async with BucketReader.open(url) as reader:
            return await reader.verify()

    problems = asyncio.run(go())
    assert [p for p in problems if line in p] == problems, problems  # that one line only
    assert main(["verify", url]) == 1
    cap = capsys.readouterr()
    assert line in cap.out and "problem(s)" in cap.err and "Traceback" not in cap.err
