"""Regenerate ``tests/data/v1/`` (run once, with the v1 publisher of commit f0b5bcf; kept for the record).

Four buckets, one per delta codec, written by the format-v1 ``DeltaPublisher`` from the same
seeded ``Trainer``: steps 0..4, anchors at 0 and 3, files of at most 4 KiB so tensors span
several chunks and files. ``expected.json`` holds, per codec and step, the sha256 of every
tensor's bf16 bytes as the trainer had them (the ground truth, not what a reader returns).

    .venv/bin/python -m tests.format.make_v1_buckets
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from tests.format.conftest import Trainer
from vllm_deltasync import DeltaPublisher

OUT = Path(__file__).resolve().parents[1] / "data" / "v1"
STEPS = 5


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    expected: dict[str, dict[str, dict[str, str]]] = {}
    for codec in ("sparse-v1", "sparse-v2", "sparse-v2-zstd"):
        trainer = Trainer(seed=7, lr=3e-6)
        url = f"file://{OUT / codec}"
        expected[codec] = {}
        with DeltaPublisher(url, anchor_every=3, max_file_bytes=4096, codec=codec) as pub:
            for step in range(STEPS):
                trainer.step()
                weights = trainer.bf16()
                pub.publish(step, weights)
                expected[codec][str(step)] = {
                    name: hashlib.sha256(t.contiguous().view(-1).view(torch.int16).numpy().tobytes()).hexdigest()
                    for name, t in sorted(weights.items())
                }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
