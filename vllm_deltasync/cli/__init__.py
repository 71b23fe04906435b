"""The ``vllm-deltasync`` command line: one table of verbs, each built by one function.

==============  ==========================================  =======================================
verb            what                                        built by
==============  ==========================================  =======================================
inspect         steps, kinds, bytes, sparsity, chains       :func:`vllm_deltasync.cli.bucket.add_inspect`
verify          every step's files and chains, no writes    :func:`vllm_deltasync.cli.bucket.add_verify`
materialize     full weights of a step as safetensors       :func:`vllm_deltasync.cli.bucket.add_materialize`
status          a fleet's sync state from ``/metrics``      :func:`vllm_deltasync.cli.status.add_parser`
import-trl      convert (or follow) a TRL delta-sync bucket :func:`vllm_deltasync.cli.trl.add_parser`
==============  ==========================================  =======================================

A builder creates its sub-parser and sets ``func`` to ``(argparse.Namespace) -> int`` (the
exit status). Errors of the :mod:`vllm_deltasync.errors` tree become one line on stderr and
exit status 1; so does any other exception (named by its class, never a traceback: hostile
buckets and servers must not be able to make the CLI dump its internals). Every line printed
for an error has its URLs redacted (:func:`vllm_deltasync._urls.redact_text`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from vllm_deltasync import __version__
from vllm_deltasync._urls import redact_text
from vllm_deltasync.errors import DeltaSyncError

VERBS: dict[str, tuple[str, str]] = {
    "inspect": ("vllm_deltasync.cli.bucket", "add_inspect"),
    "verify": ("vllm_deltasync.cli.bucket", "add_verify"),
    "materialize": ("vllm_deltasync.cli.bucket", "add_materialize"),
    "status": ("vllm_deltasync.cli.status", "add_parser"),
    "import-trl": ("vllm_deltasync.cli.trl", "add_parser"),
}
"""verb -> (module, function that adds its sub-parser); modules are imported when the parser is
built, so a verb whose optional dependency is missing shows as unavailable instead of failing."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are redacted: ``unrecognized arguments: ...`` or
    ``invalid choice: ...`` would otherwise print a URL with its secret (the sub-parsers are
    of this class too: ``add_subparsers`` takes the parent's)."""

    def error(self, message: str) -> NoReturn:
        super().error(redact_text(message))


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every verb."""
    parser = _Parser(
        prog="vllm-deltasync", description="Inspect, verify and materialize vllm-deltasync buckets."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for verb, (module_name, function) in VERBS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            subparsers.add_parser(verb, help=f"(unavailable: {exc})")
            continue
        getattr(module, function)(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(func(args) or 0)
    except DeltaSyncError as exc:
        print(f"vllm-deltasync {args.command}: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `vllm-deltasync inspect URL | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except RecursionError:
        print(f"vllm-deltasync {args.command}: input nested too deeply to read", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"vllm-deltasync {args.command}: input claims more memory than this machine has",
              file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        print(f"vllm-deltasync {args.command}: unexpected {type(exc).__name__}: {one_line(exc)}",
              file=sys.stderr)
        return 1


def one_line(exc: BaseException, limit: int = 2000) -> str:
    """``exc`` as one redacted line of at most ``limit`` characters."""
    text = " ".join(redact_text(str(exc)).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["VERBS", "build_parser", "main", "one_line"]
