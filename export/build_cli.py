"""`specedge build`: the arguments are declared in specedge/cli.py. Torch-free."""

from __future__ import annotations

import argparse
import json

from specedge.cli import fail
from specedge.runtime.errors import SpecEdgeError

from .tensorrt_build import build_engines


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def run_build(args: argparse.Namespace) -> None:
    try:
        manifest = build_engines(args.bundle, precision=args.precision,
                                 max_prompt=args.max_prompt,
                                 max_draft_tokens=args.max_draft_tokens,
                                 max_context=args.max_context, timing_cache=args.timing_cache,
                                 force=args.force)
    except (ValueError, RuntimeError, OSError, SpecEdgeError) as e:
        fail(_one_line(e))
    except KeyboardInterrupt:
        fail("interrupted; the bundle and its previous engines are unchanged")
    engines = manifest["engines"]
    print(json.dumps({"bundle": str(args.bundle),
                      "engines": {role: e["file"] for role, e in engines.items()},
                      "precision": engines["target"]["precision"],
                      "tensorrt_version": engines["target"]["tensorrt_version"]}))
