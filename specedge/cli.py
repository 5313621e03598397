"""`specedge <command>`: dispatches to the export half (torch) or the runtime half (no torch).

Only the chosen half is imported, so `specedge generate` works where torch is absent.
"""

from __future__ import annotations

import argparse
import sys

from specedge.runtime.errors import SpecEdgeError


class Parser(argparse.ArgumentParser):
    """Bad usage: one line on stderr and exit status 2, never a usage dump or a traceback."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(message: str) -> None:
    print(f"specedge: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="specedge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    from specedge.runtime import cli as runtime_cli

    runtime_cli.add_generate(sub)
    from specedge.bench.run import add_arguments as add_bench_arguments

    for name, help_text, add_arguments in (
        ("export", "Hugging Face model -> bundle (needs the export extra: pip install "
         "'specedge[export]')", add_export_arguments),
        ("distill", "train a small draft for a target on text the target generates (needs "
         "the export extra)", add_distill_arguments),
        ("build", "bundle -> TensorRT engines, on the device that will run them (needs "
         "tensorrt and cuda-python, no torch)", add_build_arguments),
        ("bench", "speculative vs plain decoding and other systems on a prompt set; writes "
         "JSON, markdown, plots", add_bench_arguments),
    ):
        add_arguments(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    if args.command == "bench":
        from specedge.bench.run import main as bench_main

        try:
            bench_main(args)
        except (ValueError, SpecEdgeError) as e:
            fail(str(e))
        return
    if args.command == "build":
        from specedge.export.build_cli import run_build

        run_build(args)
        return
    if args.command in ("export", "distill"):
        try:
            from specedge.export import cli as export_cli
        except ImportError as e:
            fail(f"`specedge {args.command}` needs the export extra ({e}): "
                 "pip install 'specedge[export]'")
        (export_cli.run if args.command == "export" else export_cli.run_distill)(args)
    else:
        runtime_cli.run_generate(args)


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder, .gguf file, or alias (smollm2-135m)")
    p.add_argument("--out", required=True, help="bundle folder to write")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--draft", help="draft checkpoint sharing the target's tokenizer")
    g.add_argument("--draft-layers", type=int, metavar="N",
                   help="draft = the target's first N layers with its norm and head")
    p.add_argument("--max-context", type=int, help="cap the context recorded in the bundle")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8", "int4"), default="fp32",
                   help="weights of both graphs; int8/int4 are weight-only (MatMulNBits), "
                   "fastest on CPU; the export reports the quantized target's change")
    p.add_argument("--attention", choices=("auto", "fused", "portable"), default="auto",
                   help="fused: ONNX Runtime's GroupQueryAttention, which writes the KV "
                   "cache in place and reads only its valid rows (ort-cpu only; Llama "
                   "family); portable: standard ONNX operators, for every backend; auto "
                   "(default): fused for int8/int4, portable for fp32/fp16")
    p.add_argument("--verify", action="store_true",
                   help="compare the graphs with transformers; fail if they disagree")
    p.add_argument("--backend", choices=("onnx", "tensorrt"), default="onnx",
                   help="onnx (default): ONNX graphs only; tensorrt: then also build fp16 "
                   "TensorRT engines for this machine's GPU (see `specedge build` for options)")
    p.add_argument("--force", action="store_true", help="re-export even if up to date")


def add_build_arguments(p: argparse.ArgumentParser) -> None:
    from specedge.runtime.draft_length import AUTO_MAX_K

    p.add_argument("--bundle", required=True, help="bundle folder made by `specedge export`; "
                   "the engines are written into it")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32", "fp8", "int8"),
                   default="fp16", help="engine precision (default fp16; normalisation and "
                   "softmax stay fp32); int8/fp8 need a graph with Q/DQ nodes")
    p.add_argument("--max-prompt", type=int, default=None,
                   help="longest prompt in tokens (default 2048, capped at the context)")
    p.add_argument("--max-draft-tokens", type=int, default=AUTO_MAX_K,
                   help=f"largest K the engines verify at once (default {AUTO_MAX_K})")
    p.add_argument("--max-context", type=int, default=None,
                   help="largest KV cache in tokens (default: the bundle's context)")
    p.add_argument("--timing-cache", metavar="PATH",
                   help="TensorRT timing cache to reuse and update (default "
                   "BUNDLE/timing.cache)")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")


def add_distill_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m",
                   help="checkpoint folder, .gguf file, or alias (default smollm2-135m)")
    p.add_argument("--out", required=True, help="draft folder (resumes a run found there)")
    p.add_argument("--kind", choices=("model", "feature"), default="model",
                   help="model: a small model on tokens; feature: one layer on the target's "
                   "features (EAGLE; runs on ort-cpu), usually accepted more often")
    p.add_argument("--layers", type=int, default=2,
                   help="decoder layers of a model draft (default 2)")
    p.add_argument("--feature-layers", type=int, nargs="+", default=[], metavar="I",
                   help="a feature draft also reads these target layers' outputs, mixed with "
                   "the last one's (EAGLE-3; 0-based, e.g. 2 15)")
    p.add_argument("--mlp-width", type=int, default=None, metavar="N",
                   help="a cheaper draft: N neurons in each draft layer's MLP, kept from the "
                   "target's largest (default: as many as the target's)")
    p.add_argument("--head-tokens", type=int, default=8192,
                   help="output head size: the most frequent tokens (default 8192)")
    p.add_argument("--prompts", type=int, default=1200,
                   help="training prompts (default 1200)")
    p.add_argument("--varied-prompts", type=int, default=0,
                   help="prompts of other shapes: questions, passage summaries and code requests "
                   "(default 0)")
    p.add_argument("--more-prompts", type=int, default=0,
                   help="further varied prompts, answered after the others: adding them to "
                   "a finished run keeps its data (default 0)")
    p.add_argument("--self-prompts", type=int, default=0,
                   help="requests the target writes itself (Magpie), filtered and answered "
                   "after the others: prompts closer to real chat; adding them to a finished "
                   "run keeps its data (default 0)")
    p.add_argument("--new-tokens", type=int, default=128, help="answer length per prompt")
    p.add_argument("--generate-batch", type=int, default=32, metavar="N",
                   help="prompts the target answers at once (default 32, as the committed "
                   "drafts were made); 128 answered SmolLM2's prompts 1.7-2x faster on 2 "
                   "cores, at 6 GB of memory instead of 2")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)


if __name__ == "__main__":
    main()
