"""`specedge generate`: stream a completion from a bundle, then print the statistics."""

from __future__ import annotations

import argparse
import json
import sys

from specedge.runtime.backends import BACKENDS
from specedge.runtime.config import DEFAULT_DRAFTER, DRAFTERS
from specedge.runtime.errors import SpecEdgeError


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a bundle (no torch needed)")
    p.add_argument("--bundle", required=True, help="bundle folder made by `specedge export`")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--raw", action="store_true", help="skip the chat template")
    add_generation_flags(p)
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding on the same prompt and print the speedup")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, stats) instead of streaming")


def add_generation_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `generate` and `chat` share: generation settings, drafting, backend and
    CPU threads (`generation_settings` turns them into `Generator.stream` settings)."""
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-tokens", type=draft_tokens_arg, default=None,
                        help="K, tokens drafted per step, or 'auto' (default: auto when greedy, "
                        "1 when sampling, so that --seed fixes the text)")
    parser.add_argument("--draft-threshold", type=float, default=0.0,
                        help="stop drafting when the draft's probability for its token is below "
                        "this (0 = off)")
    parser.add_argument("--no-draft", action="store_true", help="plain target-only decoding")
    parser.add_argument("--drafter", choices=DRAFTERS, default=DEFAULT_DRAFTER,
                        help="lookup+model (default): prompt lookup where the context repeats, "
                        "the draft model elsewhere")
    parser.add_argument("--backend", choices=BACKENDS, default="ort-cpu",
                        help="ort-cpu (default); ort-cuda and tensorrt need a GPU (tensorrt: "
                        "engines from `specedge build`); host-emulated runs the GPU backends' "
                        "code on the CPU, for testing")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")


def generation_settings(args: argparse.Namespace) -> dict:
    """`Generator.stream` keyword arguments from the flags of `add_generation_flags`."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                draft_tokens=args.draft_tokens, use_draft=not args.no_draft,
                draft_threshold=args.draft_threshold, drafter=args.drafter)


def draft_tokens_arg(value: str) -> int | str:
    """argparse type of --draft-tokens: an integer K or "auto"."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") \
            from None


def fail(message: str) -> None:
    """A usage or input error: one line on stderr, exit status 2."""
    print(f"specedge: error: {message}", file=sys.stderr)
    sys.exit(2)


def _summary(stats: dict) -> str:
    per_pos = " ".join(f"{a:.2f}" for a in stats["acceptance_per_position"])
    return (f"{stats['tokens_generated']} tokens, {stats['decode_tokens_per_second']:.1f} tok/s "
            f"decode, stop: {stats['stop_reason']}\n"
            f"drafter {stats['drafter']} K={stats['draft_tokens_k']} "
            f"(mean {stats['mean_draft_tokens']:.1f}): acceptance "
            f"{stats['acceptance_rate']:.2f} (per position {per_pos or '-'}), "
            f"{stats['tokens_per_target_call']:.2f} tokens per target call, "
            f"c={stats['draft_cost_ratio_c']:.3f}, ideal speedup {stats['ideal_speedup']:.2f}x")


def _speedup(stats: dict, plain: dict) -> float:
    """Decode tokens per second of a speculative run over plain decoding's."""
    return stats["decode_tokens_per_second"] / max(plain["decode_tokens_per_second"], 1e-9)


def _same_tokens(spec: list[int], plain: list[int], manifest: dict) -> str:
    """Greedy: whether speculative decoding gave plain decoding's tokens, and if not, why."""
    if spec == plain:
        return "; same tokens"
    at = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b),
              min(len(spec), len(plain)))
    quantized = manifest.get("quantization") or {}
    why = ("this bundle's quantized graphs are not batch invariant (a (K+1)-token "
           "verification and one-token steps differ by up to "
           f"{quantized.get('batch_max_logit_diff', 0):.2g} logits in the export's check), so a "
           "close call can go either way; export with the default fused attention, or fp32, "
           "for plain decoding's tokens"
           if quantized.get("batch_invariant") is False
           else "a near tie went the other way between a (K+1)-token call and one-token steps")
    return f"; tokens differ from token {at}: {why}"


def run_generate(args: argparse.Namespace) -> None:
    from specedge.runtime.generator import Generator

    kwargs = dict(raw=args.raw, **generation_settings(args))
    try:
        gen = Generator.from_bundle(args.bundle, backend=args.backend, threads=args.threads)
        if args.json:
            result = gen.generate(args.prompt, **kwargs)
            out = {"text": result.text, "token_ids": result.token_ids, "stats": result.stats}
            if args.compare:
                plain = gen.generate(args.prompt, **{**kwargs, "use_draft": False})
                # Greedy output must match plain decoding's; sampled output only in
                # distribution, so a sampled run has no token verdict (null).
                out |= {"plain_stats": plain.stats, "plain_token_ids": plain.token_ids,
                        "speedup": _speedup(result.stats, plain.stats),
                        "same_tokens": (result.token_ids == plain.token_ids
                                        if args.temperature == 0 else None)}
            print(json.dumps(out))
            return
        for piece in gen.stream(args.prompt, **kwargs):
            print(piece, end="", flush=True)
        print()
        spec = gen.last_result
        stats = spec.stats
        print(_summary(stats), file=sys.stderr)
        if args.compare:
            plain = gen.generate(args.prompt, **{**kwargs, "use_draft": False})
            print(f"plain decoding: {plain.stats['decode_tokens_per_second']:.1f} tok/s; "
                  f"speculative / plain = {_speedup(stats, plain.stats):.2f}x"
                  + (_same_tokens(spec.token_ids, plain.token_ids, gen.bundle.manifest)
                     if args.temperature == 0 else ""), file=sys.stderr)
    except (ValueError, SpecEdgeError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
