"""`specedge generate`: stream a completion from a bundle, then print the statistics."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from specedge.cli_common import (
    add_bundle_flag,
    add_generation_flags,
    bad_input_exits_2,
    ctrl_c_exits_130,
    generation_config,
)


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    add_bundle_flag(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, metavar="FILE",
                        help="read the prompt from FILE (UTF-8; '-' for standard input): for "
                        "long prompts")
    p.add_argument("--system", default=None,
                   help="a system message before the prompt (with the chat template)")
    p.add_argument("--raw", action="store_true", help="skip the chat template")
    add_generation_flags(p)
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding on the same prompt, the two taking turns "
                   "over --compare-rounds rounds, and print the speedup's median and range")
    p.add_argument("--compare-rounds", type=int, default=3,
                   help="rounds of --compare (default 3); one run is too noisy to quote")
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


def _check_compare(args: argparse.Namespace, config) -> None:
    """--compare needs something to compare and a decoding speed to measure."""
    if not args.compare:
        return
    if not config.use_draft:
        raise ValueError("--compare compares speculative decoding with plain decoding; drop "
                         "--no-draft")
    if config.max_new_tokens < 2:
        raise ValueError("--compare measures decoding speed, the tokens after the first: give "
                         "--max-new-tokens 2 or more")
    if args.compare_rounds < 1:
        raise ValueError(f"--compare-rounds must be >= 1, got {args.compare_rounds}")


def _compare(gen, ids: list[int], config, first, rounds: int
             ) -> tuple[list[float], object, list[tuple[float, float]]]:
    """Speedups over `rounds` rounds in which speculative and plain decoding take turns (the
    order alternating round by round; the first round's speculative run is `first`, already
    shown); returns them, the last plain result and each round's decode tokens a second
    (speculative, plain)."""
    speedups, rates = [], []
    for r in range(rounds):
        runs = {}
        for speculative in ((True, False) if r % 2 == 0 else (False, True)):
            if speculative and r == 0:
                runs[True] = first
            else:
                runs[speculative] = gen.generate(prompt_ids=ids, config=config,
                                                 use_draft=speculative)
        speedups.append(_speedup(runs[True].stats, runs[False].stats))
        rates.append((runs[True].stats["decode_tokens_per_second"],
                      runs[False].stats["decode_tokens_per_second"]))
    return speedups, runs[False], rates


def _rates(rates: list[tuple[float, float]]) -> str:
    """The decode speeds a --compare ratio is made of, round by round: each round's ratio
    is its own pair's (a median of the two modes' medians would pair speeds of different
    rounds, on a machine whose speed drifts)."""
    pairs = ", ".join(f"{spec:.1f}/{plain:.1f}" for spec, plain in rates)
    return f"decode tok/s speculative/plain by round {pairs}"


def _spread(speedups: list[float]) -> str:
    median = statistics.median(speedups)
    if len(speedups) == 1:
        return f"{median:.2f}x (one run: run more rounds before quoting it)"
    return (f"{median:.2f}x, median of {len(speedups)} rounds taking turns (range "
            f"{min(speedups):.2f}-{max(speedups):.2f}x)")


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
           "close call can go either way; export with the default batched attention, or fp32, "
           "for plain decoding's tokens"
           if quantized.get("batch_invariant") is False
           else "a near tie went the other way between a (K+1)-token call and one-token steps")
    return f"; tokens differ from token {at}: {why}"


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt
    try:
        if str(args.prompt_file) == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        return args.prompt_file.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read the prompt file: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"the prompt file is not UTF-8 text: byte {e.start} is "
                         f"{e.object[e.start:e.start + 1]!r}") from None


def _prompt_ids(gen, args: argparse.Namespace, text: str) -> list[int]:
    """The token ids of the prompt `text` (--prompt or --prompt-file), after --system when
    given."""
    if args.system is None:
        return gen.encode_prompt(text, raw=args.raw)
    if args.raw or not gen.codec.has_chat_template:
        raise ValueError("--system needs the chat template: drop --raw, or put the system "
                         "text in the prompt" if args.raw else
                         "--system needs a chat template, and this bundle has none")
    return gen.encode_prompt(messages=[{"role": "system", "content": args.system},
                                       {"role": "user", "content": text}])


def run_generate(args: argparse.Namespace) -> None:
    from specedge.runtime.generator import Generator

    with bad_input_exits_2(), ctrl_c_exits_130():
        # The settings are checked before the bundle loads (seconds), the prompt once the
        # bundle's tokenizer can encode it.
        config = generation_config(args)
        _check_compare(args, config)
        text = _read_prompt(args)
        gen = Generator.from_bundle(args.bundle, backend=args.backend, threads=args.threads,
                                    spinning=args.thread_spinning)
        ids = _prompt_ids(gen, args, text)
        greedy = config.sampling.greedy
        if args.json:
            result = gen.generate(prompt_ids=ids, config=config)
            out = {"text": result.text, "token_ids": result.token_ids, "stats": result.stats}
            if args.compare:
                speedups, plain, _ = _compare(gen, ids, config, result, args.compare_rounds)
                # Greedy output must match plain decoding's; sampled output only in
                # distribution, so a sampled run has no token verdict (null).
                out |= {"plain_stats": plain.stats, "plain_token_ids": plain.token_ids,
                        "speedup": statistics.median(speedups), "speedup_rounds": speedups,
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
            speedups, plain, rates = _compare(gen, ids, config, spec, args.compare_rounds)
            print(f"against plain decoding: {_rates(rates)}; speculative / plain = "
                  f"{_spread(speedups)}"
                  + (_same_tokens(spec.token_ids, plain.token_ids, gen.bundle.manifest)
                     if greedy else ""), file=sys.stderr)
