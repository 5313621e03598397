"""`specedge export`, `specedge build` and `specedge distill`: their arguments and what
they run.

Declaring the arguments imports nothing heavy: torch and transformers are imported when
`export` or `distill` runs, and `build` (on the device) never imports them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from specedge.cli_common import add_bundle_flag, fail
from specedge.export.steps import one_line
from specedge.runtime.drafting.auto_k import AUTO_MAX_K
from specedge.runtime.errors import SpecEdgeError

if TYPE_CHECKING:
    from specedge.export.settings import ExportSettings

# `--backend`: onnx, the graphs every ONNX Runtime backend (ort-cpu, ort-cuda) runs, or
# tensorrt, which also needs engines built for this machine's GPU.
EXPORT_BACKENDS = ("onnx", "tensorrt")


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="checkpoint folder, .gguf file, Hugging Face Hub "
                   "id, or alias (smollm2-135m); or give it as --model")
    p.add_argument("--model", dest="model_option", metavar="MODEL",
                   help="the same as the positional MODEL")
    p.add_argument("--out", required=True, help="bundle folder to write")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--draft", help="draft checkpoint sharing the target's tokenizer")
    g.add_argument("--draft-layers", type=int, metavar="N",
                   help="draft = the target's first N layers with its norm and head")
    p.add_argument("--draft-head-tokens", type=head_tokens_argument, default="auto",
                   metavar="N|all|auto",
                   help="tokens the head of a --draft-layers or --draft checkpoint draft "
                   "scores (the others get probability 0; the output stays exact): the "
                   "special tokens, the bundled prompts' tokens, then the lowest ids. auto "
                   "(default): 16384 for vocabularies over 65536, else all")
    p.add_argument("--max-context", type=int, help="cap the context recorded in the bundle")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8", "int4"), default="fp32",
                   help="weights of both graphs (default fp32); int8/int4 are weight-only "
                   "(MatMulNBits), fastest on CPU; the export reports the quantized target's "
                   "change")
    p.add_argument("--int4-grid", choices=("exact", "search"), default="exact",
                   help="int4 only: exact (default) keeps each block's float offset in a small "
                   "extra product (a GGUF Q4_1 model's weights exactly); search picks an "
                   "integer zero point per block (one MatMulNBits per weight: faster, a small "
                   "approximation)")
    p.add_argument("--int4-block", type=int, choices=(32, 64, 128), default=32,
                   help="int4 only: weights a block shares a scale and zero point with "
                   "(default 32, GGUF's Q4_1 block, which the exact grid holds; larger blocks "
                   "run faster and approximate more)")
    p.add_argument("--int4-head-bits", type=int, choices=(8, 4), default=8,
                   help="int4 only: bits of the LM head's weights (default 8, as llama.cpp "
                   "keeps its output tensor; 4 runs faster and approximates more)")
    p.add_argument("--attention", choices=("auto", "fused", "batched", "portable"), default="auto",
                   help="batched: ONNX's Attention with the cache written in place, exact "
                   "alone and in batches (serve --max-batch) on x86 and aarch64 (ort-cpu "
                   "only, onnxruntime >= 1.31); fused: ONNX Runtime's GroupQueryAttention, "
                   "which reads only the cache's valid rows but batches not (ort-cpu only; "
                   "head size a multiple of 8); portable: standard ONNX operators, for every "
                   "backend; auto (default): batched for int8/int4, portable for fp32/fp16")
    p.add_argument("--verify", action="store_true",
                   help="compare the graphs with transformers; fail if they disagree")
    p.add_argument("--backend", type=export_backend, default="onnx", metavar="{onnx,tensorrt}",
                   help="onnx (default): the ONNX graphs, which the ort-cpu and ort-cuda "
                   "backends run; tensorrt: also build TensorRT engines for this machine's "
                   "GPU (fp16; on TensorRT 11 the export's precision; see `specedge build` "
                   "for options)")
    p.add_argument("--force", action="store_true", help="re-export even if up to date")
    p.add_argument("--measure-prompts", type=int, default=8, metavar="N",
                   help="after export, run N shipped prompts (default 8; 0: skip) and store "
                   "the draft's acceptance and this machine's step costs in the bundle "
                   "(auto_k.json), where auto K starts from them")


def export_backend(value: str) -> str:
    """argparse type of export's --backend: one of EXPORT_BACKENDS; a runtime backend's name
    is answered with the export backend that serves it."""
    if value in EXPORT_BACKENDS:
        return value
    if value in ("ort-cpu", "ort-cuda"):
        raise argparse.ArgumentTypeError(f"{value} runs the bundle's ONNX graphs: export with "
                                         "--backend onnx (the default)")
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(EXPORT_BACKENDS)}, got "
                                     f"{value!r}")


# A distilled draft's head when --draft-head-tokens is auto (docs/distill.md).
DISTILL_HEAD_TOKENS = 8192


def distill_head_tokens(value: str) -> int:
    """`distill --draft-head-tokens`: an integer, or "auto" for DISTILL_HEAD_TOKENS."""
    if value == "auto":
        return DISTILL_HEAD_TOKENS
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}"
                                         ) from None


def head_tokens_argument(value: str) -> int | str:
    """`--draft-head-tokens`: "all", "auto" or an integer (its range is checked with the
    model's vocabulary, preflight.py `preflight`)."""
    if value in ("all", "auto"):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, 'all' or 'auto', got {value!r}"
                                         ) from None


def add_build_arguments(p: argparse.ArgumentParser) -> None:
    add_bundle_flag(p, help="bundle folder made by `specedge export`; the engines are "
                    "written into it")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32", "fp8", "int8"),
                   default="fp16", help="engine precision (default fp16; normalisation and "
                   "softmax stay fp32); int8/fp8 need a graph with Q/DQ nodes")
    p.add_argument("--max-prompt", type=int, default=None,
                   help="longest prompt in tokens (default 2048, capped at the context)")
    p.add_argument("--max-draft-tokens", type=int, default=AUTO_MAX_K,
                   help=f"largest K the engines verify at once (default {AUTO_MAX_K})")
    p.add_argument("--max-context", type=int, default=None,
                   help="largest KV cache in tokens (default: the bundle's context)")
    p.add_argument("--max-batch", type=int, default=1,
                   help="most sequences one call carries, for `specedge serve --max-batch N` "
                   "(default 1: one at a time; needs a bundle exported with --attention "
                   "portable)")
    p.add_argument("--timing-cache", metavar="PATH",
                   help="TensorRT timing cache to reuse and update (default "
                   "BUNDLE/timing.cache)")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")


def add_distill_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="the target: checkpoint folder, .gguf file, or "
                   "alias (default smollm2-135m); or give it as --model, as for export")
    p.add_argument("--model", "--target", dest="model_option", metavar="MODEL",
                   help="the same as the positional MODEL")
    p.add_argument("--out", required=True, help="draft folder (resumes a run found there)")
    p.add_argument("--kind", choices=("model", "feature"), default="model",
                   help="model (default): a small model on tokens; feature: one layer on the "
                   "target's features (EAGLE; runs on ort-cpu), usually accepted more often")
    p.add_argument("--layers", type=int, default=2,
                   help="decoder layers of a model draft (default 2)")
    p.add_argument("--feature-layers", type=int, nargs="+", default=[], metavar="I",
                   help="a feature draft also reads these target layers' outputs, mixed with "
                   "the last one's (EAGLE-3; 0-based, e.g. 2 15; default none)")
    p.add_argument("--mlp-width", type=int, default=None, metavar="N",
                   help="a cheaper draft: N neurons in each draft layer's MLP, kept from the "
                   "target's largest (default: as many as the target's)")
    p.add_argument("--draft-head-tokens", "--head-tokens", dest="head_tokens",
                   type=distill_head_tokens, default="auto", metavar="N|auto",
                   help="the draft's output head: the N most frequent tokens (auto, the "
                   f"default: {DISTILL_HEAD_TOKENS})")
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
    p.add_argument("--new-tokens", type=int, default=128,
                   help="answer length per prompt (default 128)")
    p.add_argument("--generate-batch", type=int, default=32, metavar="N",
                   help="prompts the target answers at once (default 32); a larger batch is "
                   "faster and takes more memory")
    p.add_argument("--corpus", metavar="DIR", default=None,
                   help="train on a corpus made by `specedge corpus` (e.g. corpora/smollm2-135m) "
                   "instead of answering --prompts here; the target's features are recomputed "
                   "from it and cached in the specedge cache")
    p.add_argument("--corpus-tokens", type=int, default=None, metavar="N",
                   help="with --corpus: only its first shards, up to N answer tokens (default: "
                   "all), to measure how agreement grows with data")
    p.add_argument("--unroll", type=int, default=1, metavar="STEPS",
                   help="with --corpus and --kind feature: drafting steps unrolled in "
                   "training (training-time test; default 1), at least the K it will draft")
    p.add_argument("--teacher-dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="with --corpus: the precision of the target's teacher-forced pass "
                   "(default auto: bf16 where the CPU runs it natively, about twice as fast)")
    p.add_argument("--train-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="precision of training's products (default fp32); bf16 runs them in "
                   "bfloat16 under autocast, weights and optimizer state staying fp32: faster "
                   "on CPUs with AVX-512 BF16 or AMX")
    p.add_argument("--epochs", type=int, default=6, help="default 6")
    p.add_argument("--init", metavar="DIR", default=None,
                   help="start training from the weights of this distilled draft folder "
                   "(the same --kind, --layers, --mlp-width and --feature-layers), e.g. the "
                   "last draft, to go on training on a grown corpus (default: untrained)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the prompts, the generation and the training (default 0)")


def add_corpus_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True,
                   help="the target's bundle, exported with --attention batched: it answers "
                   "(e.g. `specedge export smollm2-135m --precision int4 --attention batched "
                   "--out bundles/smollm2-int4-batched`)")
    p.add_argument("--out", required=True,
                   help="corpus folder: made, or grown after its last shard")
    p.add_argument("--answer-tokens", type=int, default=3_500_000, metavar="N",
                   help="grow until the corpus' answers hold N tokens (default 3500000)")
    p.add_argument("--minutes", type=float, default=None, metavar="M",
                   help="stop after about M minutes, before a shard that would not end in "
                   "time (default: no limit); run again to go on")
    p.add_argument("--max-batch", type=int, default=32, metavar="N",
                   help="requests answered at once (default 32, the fastest on 2 cores)")
    p.add_argument("--threads", type=int, default=None,
                   help="ONNX Runtime CPU threads (default: one per core)")
    p.add_argument("--new-tokens", type=int, default=256,
                   help="an answer's cap (default 256); a corpus keeps the value it started with")
    p.add_argument("--shard-prompts", type=int, default=256, metavar="N",
                   help="requests a shard answers (default 256); kept as it started")
    p.add_argument("--seed", type=int, default=0, help="seeds the requests and the sampling "
                   "(default 0); kept as it started")


# ONNX weight precisions TensorRT can parse (int8/int4 are ONNX Runtime's MatMulNBits).
TENSORRT_EXPORT_PRECISIONS = ("fp32", "fp16")


def _tensorrt_preflight(args: argparse.Namespace) -> str:
    """Before the slow export: fail now if the engines could not be built afterwards.
    Returns the engines' precision: fp16, except on a TensorRT that takes the precision from
    the graph's types (11.x, tensorrt/plan.py `strongly_typed`), where an fp32 export builds
    fp32 engines."""
    if args.precision not in TENSORRT_EXPORT_PRECISIONS:
        raise ValueError(f"--backend tensorrt needs --precision fp32 or fp16, got "
                         f"{args.precision}: int8/int4 graphs use MatMulNBits, an ONNX Runtime "
                         "operator TensorRT cannot parse")
    if args.attention in ("fused", "batched"):
        raise ValueError(f"--backend tensorrt needs --attention portable or auto: "
                         f"{args.attention} attention runs on ONNX Runtime only")
    from specedge.export.tensorrt.build import preflight
    from specedge.export.tensorrt.plan import strongly_typed

    trt, _ = preflight()
    if args.precision == "fp32" and strongly_typed(trt.__version__):
        print(f"TensorRT {trt.__version__} takes the precision from the graph: building fp32 "
              "engines (export with --precision fp16 for fp16 engines)", file=sys.stderr)
        return "fp32"
    return "fp16"


def model_argument(args: argparse.Namespace, command: str = "export",
                   default: str | None = None) -> str:
    """MODEL, given positionally or as --model (once); `default` when neither is given."""
    given = [m for m in (args.model, getattr(args, "model_option", None)) if m is not None]
    if not given and default is not None:
        return default
    if len(given) != 1:
        fail(f"give the model once: `specedge {command} MODEL --out DIR` or `specedge "
             f"{command} --model MODEL --out DIR`")
    return given[0]


def export_settings(args: argparse.Namespace, model: str) -> ExportSettings:
    """The ExportSettings of the bundle `specedge export`'s flags ask for, of `model`
    (`model_argument`). Raises ValueError for a value no export can take."""
    from specedge.export.settings import ExportSettings

    return ExportSettings(
        model=model, out=args.out, draft=args.draft, draft_layers=args.draft_layers,
        draft_head_tokens=getattr(args, "draft_head_tokens", "auto"),
        max_context=args.max_context, precision=args.precision,
        int4_grid=getattr(args, "int4_grid", "exact"),
        int4_block=getattr(args, "int4_block", 32),
        int4_head_bits=getattr(args, "int4_head_bits", 8), attention=args.attention,
        verify=args.verify, force=args.force)


def _export_modules():
    """The torch side, imported only when a command needs it."""
    try:
        from specedge.export import bundle_writer
        from specedge.export.distill import train
    except ImportError as e:
        fail(f"this command needs the export extra ({e}): pip install 'specedge[export]'")
    return bundle_writer, train


def run(args: argparse.Namespace) -> None:
    """`specedge export`: write the bundle, report its checks, build engines if asked."""
    from specedge.export.tensorrt.build import build_engines

    model = model_argument(args)
    bundle_writer, _ = _export_modules()
    tensorrt = getattr(args, "backend", "onnx") == "tensorrt"
    try:
        engine_precision = _tensorrt_preflight(args) if tensorrt else None
        manifest = bundle_writer.write_bundle(export_settings(args, model))
    except (ValueError, RuntimeError, OSError, SpecEdgeError) as e:
        # One line: the export's errors name the step and what to do (steps.py).
        fail(one_line(e))
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
                 "speculative output can part from plain decoding at near ties; the default "
                 "batched attention avoids this)"),
              file=sys.stderr)
    models = {role: m["file"] for role, m in manifest["models"].items()}
    out = {"bundle": args.out, "models": models}
    if "draft" in models and args.measure_prompts > 0 and not tensorrt:
        measured = _measure(args.out, args.measure_prompts)
        out["auto_k"] = str(measured) if measured else None
    if tensorrt:
        try:
            manifest = build_engines(args.out, precision=engine_precision, force=args.force)
        except (ValueError, RuntimeError, OSError, SpecEdgeError) as e:
            fail(f"the bundle {args.out} was exported, but building its TensorRT engines "
                 f"failed: {' '.join(str(e).split())}")
        except KeyboardInterrupt:
            fail(f"interrupted; the bundle {args.out} was exported without engines: run "
                 f"`specedge build --bundle {args.out}`")
        out["engines"] = {role: e["file"] for role, e in manifest["engines"].items()}
    print(json.dumps(out))


def _measure(bundle: str, prompts: int):
    """calibrate.calibrate; the measurement is optional (auto K then starts from its
    prior), so its failure is a warning and the export still succeeds."""
    from specedge.export.calibrate import calibrate

    try:
        return calibrate(bundle, prompts)
    except (ValueError, RuntimeError, OSError, SpecEdgeError) as e:
        print(f"specedge export: warning: the bundle {bundle} was exported, but measuring its "
              f"draft failed ({one_line(e)}); auto K starts from its prior until `specedge "
              "bench --store-auto-k` measures it", file=sys.stderr)
        return None
    except KeyboardInterrupt:
        fail(f"interrupted; the bundle {bundle} was exported without auto_k.json")


def run_distill(args: argparse.Namespace) -> None:
    """`specedge distill`: train a draft for a target; resumable."""
    _, train = _export_modules()
    target = model_argument(args, "distill", default="smollm2-135m")
    cfg = train.DistillConfig(target=target, kind=args.kind, layers=args.layers,
                        head_tokens=args.head_tokens, prompts=args.prompts,
                        varied_prompts=args.varied_prompts,
                        more_prompts=args.more_prompts, self_prompts=args.self_prompts,
                        feature_layers=args.feature_layers, mlp_width=args.mlp_width,
                        new_tokens=args.new_tokens, generate_batch=args.generate_batch,
                        epochs=args.epochs, seed=args.seed, corpus=args.corpus,
                        corpus_tokens=args.corpus_tokens, unroll=args.unroll,
                        teacher_dtype=args.teacher_dtype, train_dtype=args.train_dtype,
                        init=args.init)
    try:
        meta = train.distill(args.out, cfg)
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


def run_corpus(args: argparse.Namespace) -> None:
    """`specedge corpus`: grow a distillation corpus with the target's answers; resumable."""
    try:
        from specedge.export.distill.corpus import CorpusSettings
        from specedge.export.distill.grow import grow_corpus
    except ImportError as e:
        fail(f"this command needs the export extra ({e}): pip install 'specedge[export]'")
    settings = CorpusSettings(new_tokens=args.new_tokens, shard_prompts=args.shard_prompts,
                              seed=args.seed)
    try:
        report = grow_corpus(args.out, args.bundle, settings, args.answer_tokens,
                             args.minutes, args.max_batch, args.threads)
    except (ValueError, RuntimeError, OSError, SpecEdgeError) as e:
        fail(one_line(e))
    except KeyboardInterrupt:
        fail(f"interrupted; the shards written are kept: run the same command to go on "
             f"growing {args.out}")
    print(f"corpus {args.out}: {report['shards']} shards, {report['rows']} answers, "
          f"{report['answer_tokens']} answer tokens", file=sys.stderr)
    print(json.dumps(report))


def run_build(args: argparse.Namespace) -> None:
    """`specedge build`: TensorRT engines into the bundle. Torch-free."""
    from specedge.export.tensorrt.build import build_engines

    try:
        manifest = build_engines(args.bundle, precision=args.precision,
                                 max_prompt=args.max_prompt,
                                 max_draft_tokens=args.max_draft_tokens,
                                 max_context=args.max_context, timing_cache=args.timing_cache,
                                 force=args.force, max_batch=args.max_batch)
    except (ValueError, RuntimeError, OSError, SpecEdgeError) as e:
        fail(one_line(e))
    except KeyboardInterrupt:
        fail("interrupted; the bundle and its previous engines are unchanged")
    engines = manifest["engines"]
    print(json.dumps({"bundle": str(args.bundle),
                      "engines": {role: e["file"] for role, e in engines.items()},
                      "precision": engines["target"]["precision"],
                      "tensorrt_version": engines["target"]["tensorrt_version"]}))
