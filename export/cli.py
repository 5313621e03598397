"""`specedge export`: the arguments are declared in specedge/cli.py."""

from __future__ import annotations

import argparse
import json
import sys

from specedge.cli import fail
from specedge.runtime.errors import SpecEdgeError

from .bundle import export_bundle
from .distill import DistillConfig, distill
from .tensorrt_build import build_engines, preflight

# ONNX weight precisions TensorRT can parse (int8/int4 are ONNX Runtime's MatMulNBits).
TENSORRT_EXPORT_PRECISIONS = ("fp32", "fp16")


def _tensorrt_preflight(args: argparse.Namespace) -> None:
    """Before the slow export: fail now if the engines could not be built afterwards."""
    if args.precision not in TENSORRT_EXPORT_PRECISIONS:
        raise ValueError(f"--backend tensorrt needs --precision fp32 or fp16, got "
                         f"{args.precision}: int8/int4 graphs use MatMulNBits, an ONNX Runtime "
                         "operator TensorRT cannot parse")
    if args.attention == "fused":
        raise ValueError("--backend tensorrt needs --attention portable or auto: fused "
                         "attention is an ONNX Runtime operator TensorRT cannot parse")
    preflight()


def run(args: argparse.Namespace) -> None:
    tensorrt = getattr(args, "backend", "onnx") == "tensorrt"
    try:
        if tensorrt:
            _tensorrt_preflight(args)
        manifest = export_bundle(args.model, args.out, draft=args.draft,
                                 draft_layers=args.draft_layers, max_context=args.max_context,
                                 precision=args.precision, attention=args.attention,
                                 verify=args.verify, force=args.force)
    except (ValueError, RuntimeError, OSError, SpecEdgeError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted; nothing was written")
    for role, report in (manifest.get("verify") or {}).items():
        print(f"verify {role}: max |logit diff| {report['max_abs_logit_diff']:.2e} "
              f"(atol {report['atol']:g}), greedy {report['greedy_matches']}/"
              f"{report['greedy_steps']} tokens match", file=sys.stderr)
    q = manifest.get("quantization")
    if q:
        print(f"{manifest['precision']} target vs fp32: greedy agreement "
              f"{q['greedy_agreement']:.0%} over {q['greedy_steps']} steps, perplexity "
              f"{q['perplexity_fp32']:.2f} -> {q['perplexity']:.2f} "
              f"({q['perplexity_change']:+.1%}); max logit difference "
              f"{q.get('batch_max_logit_diff', 0):.1e} between a 4-token call and 4 steps"
              + ("" if q.get("batch_invariant", True) else " (not batch invariant: greedy "
                 "speculative output can part from plain decoding at near ties)"),
              file=sys.stderr)
    models = {role: m["file"] for role, m in manifest["models"].items()}
    out = {"bundle": args.out, "models": models}
    if tensorrt:
        try:
            manifest = build_engines(args.out, force=args.force)
        except (ValueError, RuntimeError, OSError, SpecEdgeError) as e:
            fail(f"the bundle {args.out} was exported, but building its TensorRT engines "
                 f"failed: {' '.join(str(e).split())}")
        except KeyboardInterrupt:
            fail(f"interrupted; the bundle {args.out} was exported without engines: run "
                 f"`specedge build --bundle {args.out}`")
        out["engines"] = {role: e["file"] for role, e in manifest["engines"].items()}
    print(json.dumps(out))


def run_distill(args: argparse.Namespace) -> None:
    cfg = DistillConfig(target=args.target, kind=args.kind, layers=args.layers,
                        head_tokens=args.head_tokens, prompts=args.prompts,
                        varied_prompts=args.varied_prompts,
                        more_prompts=args.more_prompts, self_prompts=args.self_prompts,
                        feature_layers=args.feature_layers, mlp_width=args.mlp_width,
                        new_tokens=args.new_tokens, generate_batch=args.generate_batch,
                        epochs=args.epochs, seed=args.seed)
    try:
        meta = distill(args.out, cfg)
    except (ValueError, RuntimeError, OSError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail(f"interrupted; run the same command again to resume from {args.out}/work")
    report = meta["report"]
    print(f"{meta['kind']} draft: {meta['num_layers']} layers, "
          f"{len(meta['head_token_ids'])} head tokens, "
          f"trained on {meta['answer_tokens']} target tokens in {meta['seconds']} s; "
          f"held-out top-1 agreement with the target {report['val_top1_agreement']:.2f}",
          file=sys.stderr)
    print(json.dumps({"draft": args.out, "report": report}))
