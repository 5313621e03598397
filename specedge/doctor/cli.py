"""`specedge doctor [--bundle B] [--json]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specedge.cli_common import add_threads_flag
from specedge.doctor.report import gather, render


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", type=Path, default=None,
                   help="also load this bundle on every backend that runs here: its load "
                   "time and one decoding step's")
    add_threads_flag(p, "ONNX Runtime CPU threads for the bundle (default: one per core)")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    """Print the report; 2 when --bundle cannot be read (the device's report first, then
    the bundle's error, also as one line on stderr), 1 when it loads on no backend here,
    else 0."""
    report = gather(args.bundle, args.threads)
    print(json.dumps(report, indent=2) if args.json else render(report))
    bundle = report["bundle"]
    if bundle and bundle["error"]:
        print(f"specedge doctor: error: {bundle['error']}", file=sys.stderr)
        return 2
    return 1 if bundle and not any(r["loads"] for r in bundle["backends"]) else 0
