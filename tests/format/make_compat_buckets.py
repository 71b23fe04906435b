"""Regenerate the compatibility buckets under ``tests/data/`` (kept for the record; each was
written once by the publisher of the release named below and must never be rewritten).

* ``tests/data/v1/``: format version 1, written by the v1 publisher of commit f0b5bcf
  (``sparse-v1``, ``sparse-v2``, ``sparse-v2-zstd``).
* ``tests/data/v2/``: format version 2, written by the 0.3.0 publisher of commit 664685b
  (``sparse-v2``, ``sparse-v3``; ``sparse-v3`` was 0.3.0's default).

One bucket per delta codec, written by ``DeltaPublisher`` from the same seeded ``Trainer``:
steps 0..4, anchors at 0 and 3, files of at most 4 KiB so tensors span several chunks and
files. ``expected.json`` holds, per codec and step, the sha256 of every tensor's bf16 bytes as
the trainer had them (the ground truth, not what a reader returns).

    .venv/bin/python -m tests.format.make_compat_buckets 2
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

from tests.helpers.publishing import Trainer
from vllm_deltasync import DeltaPublisher

DATA = Path(__file__).resolve().parents[1] / "data"
STEPS = 5
CODECS = {1: ("sparse-v1", "sparse-v2", "sparse-v2-zstd"), 2: ("sparse-v2", "sparse-v3")}


def main(version: int) -> None:
    out = DATA / f"v{version}"
    shutil.rmtree(out, ignore_errors=True)
    expected: dict[str, dict[str, dict[str, str]]] = {}
    for codec in CODECS[version]:
        trainer = Trainer(seed=7, lr=3e-6)
        url = f"file://{out / codec}"
        expected[codec] = {}
        with DeltaPublisher(url, anchor_every=3, max_file_bytes=4096, codec=codec,
                            format_version=version) as pub:
            for step in range(STEPS):
                trainer.step()
                weights = trainer.bf16()
                pub.publish(step, weights)
                expected[codec][str(step)] = {
                    name: hashlib.sha256(t.contiguous().view(-1).view(torch.int16).numpy().tobytes()).hexdigest()
                    for name, t in sorted(weights.items())
                }
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]))
