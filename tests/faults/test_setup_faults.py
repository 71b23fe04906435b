"""Fault matrix, the project's own scripts (item 9): ``scripts/setup.sh`` installs Debian's
prometheus and nginx-light packages without the packages' services starting (a policy-rc.d it removes only if
it created it) and never stops anything it did not start, such as a user's own Prometheus.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"


def _prometheus_block() -> str:
    text = SETUP.read_text()
    start = text.index("# Prometheus + promtool")
    return text[start: text.index('rm -f "$VENV"', start)]


def test_setup_never_stops_a_process_by_name() -> None:
    code = "\n".join(line.split("#", 1)[0] for line in SETUP.read_text().splitlines())
    assert not re.search(r"\b(pkill|killall)\b|service\s+\S+\s+stop|systemctl\s+stop", code)


def _run_block(tmp_path: Path, existing_policy: bool) -> tuple[list[str], Path]:
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "calls"
    policy = tmp_path / "policy-rc.d"
    if existing_policy:
        policy.write_text("#!/bin/sh\nexit 0\n")
    for tool in ("printf", "chmod", "rm", "cat"):
        found = next(Path(d) / tool for d in ("/usr/bin", "/bin") if (Path(d) / tool).exists())
        (fake / tool).symlink_to(found)
    (fake / "id").write_text("#!/bin/sh\necho 0\n")
    # apt-get records whether services were forbidden while it ran (policy-rc.d exits 101)
    (fake / "apt-get").write_text(
        f"#!/bin/sh\necho \"apt-get $* policy=$(/bin/sh {policy} prometheus start >/dev/null 2>&1; "
        f"echo $?)\" >>{calls}\n")
    for stopper in ("pkill", "killall", "service", "systemctl"):
        (fake / stopper).write_text(f"#!/bin/sh\necho \"{stopper} $*\" >>{calls}\n")
    for f in fake.iterdir():
        if not f.is_symlink():
            f.chmod(0o755)
    env = {"PATH": str(fake), "DELTASYNC_POLICY_RC_D": str(policy), "VENV": str(tmp_path)}
    result = subprocess.run(["/bin/bash", "-c", _prometheus_block()], env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return (calls.read_text().splitlines() if calls.exists() else []), policy


def test_setup_keeps_the_package_service_from_starting(tmp_path: Path) -> None:
    calls, policy = _run_block(tmp_path, existing_policy=False)
    installs = [c for c in calls if c.startswith("apt-get") and "install" in c]
    assert installs and all(c.endswith("policy=101") for c in installs), calls
    assert all(" prometheus " in c and " nginx-light " in c for c in installs), calls
    assert not any(c.split()[0] in ("pkill", "killall", "service", "systemctl") for c in calls)
    assert not policy.exists()  # it created the policy, so it removed it


def test_setup_leaves_an_existing_policy_alone(tmp_path: Path) -> None:
    _, policy = _run_block(tmp_path, existing_policy=True)
    assert policy.read_text() == "#!/bin/sh\nexit 0\n"
    assert os.access(policy, os.R_OK)
