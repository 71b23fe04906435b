"""``vllm-deltasync import-trl SRC DST``: replay a TRL delta-sync bucket into ours."""

from __future__ import annotations

import argparse
import threading

from vllm_deltasync.cli.bucket import check_source
from vllm_deltasync.trainer.publisher import DeltaPublisher
from vllm_deltasync.trainer.trl_import import TrlImporter


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``import-trl SRC DST`` verb."""
    p = subparsers.add_parser("import-trl", help="convert (or --follow) a TRL delta-sync bucket")
    p.add_argument("src", help="URL of the TRL bucket (anchors/, deltas/)")
    p.add_argument("dst", help="URL of the vllm-deltasync bucket to write")
    p.add_argument("--codec", default="sparse-v2", help="delta encoding (default sparse-v2)")
    p.add_argument("--anchor-every", type=int, default=10)
    p.add_argument("--follow", action="store_true", help="keep importing new steps")
    p.add_argument("--poll-interval-s", type=float, default=5.0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``import-trl``; exit status 0. Errors of the tree propagate to the CLI."""
    if not args.follow:  # --follow may start before the trainer made its bucket
        check_source(args.src)
    with (DeltaPublisher(args.dst, codec=args.codec, anchor_every=args.anchor_every) as publisher,
          TrlImporter(args.src, publisher) as importer):  # both close their stores' sessions
        if args.follow:
            try:
                importer.follow(args.poll_interval_s, threading.Event())
            except KeyboardInterrupt:
                return 0
        steps = importer.import_new()
        print(f"imported {len(steps)} steps" + (f" ({steps[0]}..{steps[-1]})" if steps else ""))
    return 0


__all__ = ["add_parser", "run"]
