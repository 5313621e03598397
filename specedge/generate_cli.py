"""`specedge generate`: stream a completion from a bundle, then print the statistics."""

from __future__ import annotations

import argparse
import json
import sys

from specedge.cli_common import (
    add_bundle_flag,
    add_generation_flags,
    bad_input_exits_2,
    ctrl_c_exits_130,
    generation_config,
)


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a bundle (no torch needed)")
    add_bundle_flag(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--raw", action="store_true", help="skip the chat template")
    add_generation_flags(p)
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding on the same prompt and print the speedup")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, stats) instead of streaming")


def summary(stats: dict) -> str:
    """The statistics of one generation in two lines, as `generate` and `chat` print them."""
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

    with bad_input_exits_2(), ctrl_c_exits_130():
        gen = Generator.from_bundle(args.bundle, backend=args.backend, threads=args.threads,
                                    spinning=args.thread_spinning)
        # The prompt is checked before the settings, in the order a generation checks them.
        ids = gen.encode_prompt(args.prompt, raw=args.raw)
        config = generation_config(args)
        greedy = config.sampling.greedy
        if args.json:
            result = gen.generate(prompt_ids=ids, config=config)
            out = {"text": result.text, "token_ids": result.token_ids, "stats": result.stats}
            if args.compare:
                plain = gen.generate(prompt_ids=ids, config=config, use_draft=False)
                # Greedy output must match plain decoding's; sampled output only in
                # distribution, so a sampled run has no token verdict (null).
                out |= {"plain_stats": plain.stats, "plain_token_ids": plain.token_ids,
                        "speedup": _speedup(result.stats, plain.stats),
                        "same_tokens": (result.token_ids == plain.token_ids
                                        if greedy else None)}
            print(json.dumps(out))
            return
        for piece in gen.stream(prompt_ids=ids, config=config):
            print(piece, end="", flush=True)
        print()
        spec = gen.last_result
        stats = spec.stats
        print(summary(stats), file=sys.stderr)
        if args.compare:
            plain = gen.generate(prompt_ids=ids, config=config, use_draft=False)
            print(f"plain decoding: {plain.stats['decode_tokens_per_second']:.1f} tok/s; "
                  f"speculative / plain = {_speedup(stats, plain.stats):.2f}x"
                  + (_same_tokens(spec.token_ids, plain.token_ids, gen.bundle.manifest)
                     if greedy else ""), file=sys.stderr)
