"""Where things live in a bucket: the one definition of manifest and data paths.

```
<prefix>/manifests/000000000042.json                  the commit point of step 42
<prefix>/data/000000000042-<token>/00000.safetensors  data files of one publish attempt of step 42
```

Format v2 tokens are ``<writer>-<attempt>`` (both lowercase hex), v1 tokens one hex string.

Every path here is relative to the bucket URL's prefix (stores strip it). Step numbers are
zero-padded to 12 digits so listing order is step order; the random lowercase-hex token makes
every publish attempt write new names.
"""

from __future__ import annotations

import re

from vllm_deltasync.errors import FormatError

STEP_DIGITS = 12
MANIFEST_DIR = "manifests"
DATA_DIR = "data"

_MANIFEST_RE = re.compile(rf"^{MANIFEST_DIR}/(\d{{{STEP_DIGITS}}})\.json$")
_DATA_RE = re.compile(rf"^{DATA_DIR}/(\d{{{STEP_DIGITS}}})-([0-9a-f]+(?:-[0-9a-f]+)?)/")
_TOKEN_RE = re.compile(r"[0-9a-f]+(?:-[0-9a-f]+)?")
MAX_STEP = 10**STEP_DIGITS - 1
"""The largest step number (steps are named by ``STEP_DIGITS`` digits)."""


def check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise FormatError(f"step {step!r} is not an integer in [0, {MAX_STEP}]")


def manifest_path(step: int) -> str:
    """``42`` -> ``"manifests/000000000042.json"``."""
    check_step(step)
    return f"{MANIFEST_DIR}/{step:0{STEP_DIGITS}d}.json"


def parse_manifest_path(path: str) -> int | None:
    """The step of a manifest path, or None if ``path`` is not one."""
    match = _MANIFEST_RE.match(path)
    return int(match.group(1)) if match else None


def data_dir(step: int, token: str) -> str:
    """``(42, "9f3a")`` -> ``"data/000000000042-9f3a"``: the folder of one publish attempt."""
    check_step(step)
    if not _TOKEN_RE.fullmatch(token):
        raise FormatError(f"data token {token!r} must be lowercase hex, or <writer>-<attempt> in hex")
    return f"{DATA_DIR}/{step:0{STEP_DIGITS}d}-{token}"


def data_path(step: int, token: str, index: int) -> str:
    """Path of the ``index``-th data file of one publish attempt."""
    return f"{data_dir(step, token)}/{index:05d}.safetensors"


def attempt_token(writer: str, attempt: str) -> str:
    """v2 data folder token ``<writer>-<attempt>``: retention can tell whose data it is."""
    return f"{writer}-{attempt}"


def token_writer(token: str) -> str | None:
    """The writer token inside a v2 data folder token; None for a v1 (anonymous) one."""
    return token.split("-", 1)[0] if "-" in token else None


def parse_data_path(path: str) -> tuple[int, str] | None:
    """``(step, token)`` of a path under ``data/``, or None if it is not one."""
    match = _DATA_RE.match(path)
    return (int(match.group(1)), match.group(2)) if match else None


__all__ = ["DATA_DIR", "MANIFEST_DIR", "MAX_STEP", "STEP_DIGITS", "attempt_token", "check_step", "token_writer", "data_dir", "data_path",
           "manifest_path", "parse_data_path", "parse_manifest_path"]
