"""examples/publish_local.py end to end (tiny settings), then the console script on its bucket."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.publishing import REPO, run_cli
from vllm_deltasync.cli import main


def test_example_publishes_a_readable_bucket(tmp_path: Path) -> None:
    argv = [sys.executable, str(REPO / "examples" / "publish_local.py"), "--out", str(tmp_path),
            "--steps", "4", "--anchor-every", "3", "--hidden", "64", "--layers", "1", "--vocab", "300",
            "--seq", "16", "--batch", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"step +(\d+) (anchor|delta) +changed +(\d+) +sparsity +([\d.]+)%", done.stdout)
    assert [(int(s), k) for s, k, _, _ in rows] == [(0, "anchor"), (1, "delta"), (2, "delta"), (3, "anchor")]
    assert all(90.0 < float(sp) < 100.0 for _, k, _, sp in rows if k == "delta"), done.stdout

    url = f"file://{tmp_path / 'bucket'}"
    inspect = run_cli("inspect", url, "--json")
    assert inspect.returncode == 0, inspect.stderr
    steps = json.loads(inspect.stdout)["steps"]
    assert [(s["step"], s["changed"]) for s in steps] == [(int(s), int(c)) for s, _, c, _ in rows]
    assert main(["verify", url]) == 0
