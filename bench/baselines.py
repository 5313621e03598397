"""What users would run instead, measured on the same prompts and token budget (greedy),
with each system's perplexity on one text (`quality_text_ids`): a speed ratio means
something only between systems of comparable quality.

Each baseline is skipped, with the reason recorded, when its package is not installed.

A system is a dict with `generate` (prompt ids -> `Generation`) and what to report with it,
or with `skipped`: the reason it is not timed. `time_systems` times every `generate` call
end to end and takes the decode time from the `Generation` it returns.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from specedge.bench.intervals import ratio_ci
from specedge.bench.perplexity import perplexity
from specedge.runtime.text import TextCodec


class Generation(NamedTuple):
    """What a system's `generate` returns for one prompt.

    `tokens`: the tokens it generated. `decode_seconds`: seconds from the arrival of its
    first generated token to the end of the generation, measured by the system itself (so
    prompt evaluation and the first token are left out). `first_tokens`: how many tokens
    arrived together first, 1 unless one call returns several (transformers' assisted
    generation verifies drafts in its first call): they are left out of the decode speed,
    which is (tokens - first_tokens) / decode_seconds. The end-to-end time is not part of
    it: `time_systems` measures it around the call, the same way for every system.
    """

    tokens: int
    decode_seconds: float
    first_tokens: int = 1

QUALITY_TOKENS = 512
# Candidates per step for transformers' prompt lookup (Saxena 2023), which has no default.
# On the bench's first 8 prompts (SmolLM2-135M fp32, interleaved, one run): 3, 4 and 10
# gave 10.9, 11.1 and 10.2 tok/s, against 13.0 for its plain decoding.
PROMPT_LOOKUP_TOKENS = 4


def quality_text_ids(codec: TextCodec, prompts: list[dict]) -> list[int]:
    """The passages of the prompt set's summaries (hand-written prose, no chat template),
    encoded and cut at QUALITY_TOKENS: the text every system's perplexity is measured on
    (through the bundle's tokenizer, so every system scores the same ids)."""
    passages = [p["prompt"].split("\n\n", 1)[1] for p in prompts
                if p["category"] == "summarize" and "\n\n" in p["prompt"]]
    if not passages:
        raise ValueError("the prompt set has no summarize prompts with a passage")
    return codec.encode("\n\n".join(passages))[:QUALITY_TOKENS]


def _hf_models(bundle: Path):
    """The bundle's target and draft as transformers models (the export extra)."""
    from specedge.export.distill.draft_folder import is_distilled_draft, load_draft
    from specedge.export.drafts.feature import FeatureDraft
    from specedge.export.drafts.truncated import truncated_draft
    from specedge.export.sources import load_model

    source = json.loads((bundle / "manifest.json").read_text())["source"]
    target, tokenizer = load_model(source["model"])
    draft = None
    if source.get("draft") and is_distilled_draft(source["draft"]):
        draft = load_draft(Path(source["draft"]), target, tokenizer)
        if isinstance(draft, FeatureDraft):
            return target, None  # an assistant must be a causal LM that reads tokens only
        # transformers' assistant scores the whole vocabulary with the tied head.
        del draft.specedge_head_ids
    elif source.get("draft"):
        draft = load_model(source["draft"])[0]
    elif source.get("draft_layers"):
        draft = truncated_draft(target, source["draft_layers"])
    return target, draft


def transformers_systems(bundle: Path, max_new_tokens: int, text_ids: list[int]) -> dict:
    """transformers plain greedy and its assisted generation, with the bundle's draft as
    assistant and with prompt lookup, as `time_systems` takes them. Prompt lookup needs no
    draft, so a bundle whose draft transformers cannot run (a feature draft) is still
    compared with transformers' speculative decoding."""
    names = ("transformers plain", "transformers assisted", "transformers prompt lookup")
    if importlib.util.find_spec("torch") is None:
        return {name: {"skipped": "torch / transformers not installed "
                                  "(pip install -e '.[export]')"} for name in names}
    import torch
    from transformers.generation.streamers import BaseStreamer

    class FirstArrival(BaseStreamer):
        """When the first generated tokens arrive, and how many: transformers puts the
        prompt first, then each step's new tokens."""

        def __init__(self) -> None:
            self.puts, self.at, self.tokens = 0, None, 0

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.at, self.tokens = time.perf_counter(), int(value.numel())

        def end(self) -> None:
            pass

    target, draft = _hf_models(bundle)
    with torch.no_grad():
        logits = target(torch.tensor([text_ids])).logits[0].float().numpy()
    quality = perplexity(logits, text_ids)  # assisted generation samples the target too

    def system(**kwargs) -> dict:
        def generate(ids: list[int]) -> Generation:
            first = FirstArrival()
            with torch.no_grad():
                out = target.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                      min_new_tokens=max_new_tokens, do_sample=False,
                                      streamer=first, **kwargs)
            end = time.perf_counter()
            return Generation(out.shape[1] - len(ids),
                              end - first.at if first.at is not None else 0.0,
                              first.tokens or 1)
        return {"generate": generate, "perplexity": quality}

    return {names[0]: system(),
            names[1]: system(assistant_model=draft) if draft is not None else {
                "skipped": "the bundle has no draft that transformers can run (a feature "
                           "draft reads the target's features)"},
            names[2]: system(prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)}


def _llama_cpp_batch(gguf: Path, threads: int) -> int:
    """512 when llama.cpp evaluates a multi-token batch on this CPU, else 1. On some CPUs
    (a build with native CPU features) such a batch crashes the process
    (docs/bench.md#building-llama-cpp-python), so it
    is tried once in a child process first."""
    probe = ("import sys; from llama_cpp import Llama; "
             "llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=int(sys.argv[2]), "
             "n_batch=512, verbose=False); llm.eval(llm.tokenize(b'Hello there, how are you "
             "doing today? I am fine.'))")
    try:
        done = subprocess.run([sys.executable, "-c", probe, str(gguf), str(threads)],
                              capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        return 1
    return 512 if done.returncode == 0 else 1


# llama-cpp-python's own speculative mode: prompt-lookup decoding, its default 10 tokens.
LLAMA_CPP_LOOKUP_TOKENS = 10
LLAMA_CPP = ("llama.cpp plain", "llama.cpp prompt lookup")  # its plain and lookup systems


def llama_cpp_build() -> str:
    """What the installed llama.cpp was built with (its system info: AVX2, AVX512, ...)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    return (info.decode() if isinstance(info, bytes) else str(info)).strip()


def llama_cpp_systems(gguf: Path | None, max_new_tokens: int, threads: int,
                      text_ids: list[int]) -> dict:
    """llama.cpp (llama-cpp-python) greedy decoding on the GGUF in its fastest modes, as
    `time_systems` takes it: plain with flash attention, and with its prompt-lookup
    decoding; both report the build's instruction sets."""
    names = LLAMA_CPP
    if importlib.util.find_spec("llama_cpp") is None:
        return dict.fromkeys(names, {"skipped": "llama-cpp-python not installed "
                                                "(bash scripts/install_llama_cpp.sh)"})
    if gguf is None:
        return dict.fromkeys(names, {"skipped": "no GGUF for this bundle"})
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    n_batch = _llama_cpp_batch(gguf, threads)
    # Every position's logits, for the perplexity: slower, so not the timed instance.
    scorer = Llama(model_path=str(gguf), n_ctx=len(text_ids), n_threads=threads,
                   n_batch=n_batch, logits_all=True, verbose=False)
    scorer.eval(text_ids)
    quality = perplexity(np.asarray(scorer.scores[:len(text_ids)]), text_ids)
    del scorer
    shared = {"perplexity": quality, "n_batch": n_batch, "flash_attn": True,
              "build": llama_cpp_build()}

    def system(**extra) -> dict:
        llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_batch=n_batch,
                    flash_attn=True, verbose=False, **extra)

        def generate(ids: list[int]) -> Generation:
            llm.reset()  # no prefix of the last prompt reused from the cache
            n, first = 0, None
            for n, _ in enumerate(llm.generate(ids, top_k=1, top_p=1.0, temp=0.0,
                                               reset=True), start=1):
                if first is None:  # the prompt is evaluated before the first yield
                    first = time.perf_counter()
                if n >= max_new_tokens:
                    break
            end = time.perf_counter()
            return Generation(n, end - first if first is not None else 0.0)

        return {"generate": generate, **shared}

    lookup = LlamaPromptLookupDecoding(num_pred_tokens=LLAMA_CPP_LOOKUP_TOKENS)
    return {names[0]: system(),
            names[1]: {**system(draft_model=lookup), "lookup_tokens": LLAMA_CPP_LOOKUP_TOKENS}}


def _speeds(calls: list[tuple[Generation, float]]) -> dict:
    """One round of one system from its (generation, end-to-end seconds) per prompt: totals
    and both speeds, each a ratio of sums (docs/bench.md#reading-the-ratios). The decode
    speed is None when no time was spent decoding (every generation stopped at its first
    token)."""
    tokens = sum(g.tokens for g, _ in calls)
    seconds = sum(wall for _, wall in calls)
    decode_tokens = sum(max(0, g.tokens - g.first_tokens) for g, _ in calls)
    decode_seconds = sum(g.decode_seconds for g, _ in calls)
    return {"tokens": tokens, "seconds": seconds, "decode_tokens": decode_tokens,
            "decode_seconds": decode_seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else None,
            "decode_tokens_per_second": decode_tokens / decode_seconds
            if decode_seconds > 0 else None}


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def time_systems(systems: dict[str, dict], prompt_ids: list[list[int]], rounds: int = 1,
                 progress: bool = False) -> dict[str, dict]:
    """Each system's tokens per second on the same prompt ids, `rounds` times over: end to
    end (each `generate` call timed here, prompt evaluation included) and decode (tokens
    after the first over the time after the first arrived, from the `Generation` the system
    returns). A system is a dict with `generate` and what to report with it, or with
    `skipped`: the reason it is not timed (reported as it is).

    Each round, the systems take turns prompt by prompt, the first of them changing every
    prompt (and continuing round after round, so that a prompt's first system changes
    between rounds too), so the machine's drift over the run falls on all of them alike. Run
    one after another (llama.cpp after ours), llama.cpp's ratio to ours was 0.99x and 1.54x
    in two runs of the same code within an hour. Each system generates once, untimed, to
    warm up, before the first round.

    A timed system's result holds `rounds` (per round: tokens, seconds, decode_tokens,
    decode_seconds, tokens_per_second, decode_tokens_per_second) and the median over rounds
    of both speeds (`tokens_per_second`, `decode_tokens_per_second`). `progress` shows a
    bar on stderr, advanced once per generation.
    """
    from tqdm import tqdm

    if rounds < 1:
        raise ValueError(f"rounds must be 1 or more, got {rounds}")
    timed = [name for name, s in systems.items() if "generate" in s]
    bar = tqdm(total=len(timed) * (len(prompt_ids) * rounds + 1), desc="systems",
               unit="run", file=sys.stderr, disable=not progress)
    for name in timed:
        systems[name]["generate"](prompt_ids[0])
        bar.update()
    calls = {name: [[] for _ in range(rounds)] for name in timed}
    turn = 0
    for r in range(rounds):
        for ids in prompt_ids:
            first = turn % len(timed) if timed else 0
            turn += 1
            for name in timed[first:] + timed[:first]:
                t0 = time.perf_counter()
                generation = systems[name]["generate"](ids)
                wall = time.perf_counter() - t0
                if not isinstance(generation, Generation):
                    raise TypeError(f"{name}: generate returned {type(generation).__name__}, "
                                    "not a baselines.Generation (tokens, decode_seconds, "
                                    "first_tokens)")
                calls[name][r].append((generation, wall))
                bar.update()
    bar.close()
    results = {}
    for name, system in systems.items():
        results[name] = {k: v for k, v in system.items() if k != "generate"}
        if name in calls:
            per_round = [_speeds(c) for c in calls[name]]
            results[name].update(
                tokens_per_second=_median([x["tokens_per_second"] for x in per_round]),
                decode_tokens_per_second=_median([x["decode_tokens_per_second"]
                                                  for x in per_round]),
                rounds=per_round)
    return results


# The two speeds of a system, as named in the ratios: key of `time_systems`' results.
SPEEDS = {"decode": "decode_tokens_per_second", "end to end": "tokens_per_second"}


# The peers the ratios are quoted against: each one's systems are named "<peer> ...", its
# plain decoding "<peer> plain" (for onnxruntime-genai, its model builder's CPU defaults).
PEERS = ("llama.cpp", "onnxruntime-genai", "openvino-genai")


def _ratio(timed: dict[str, dict], num: str, den: str, speed: str) -> dict | None:
    """`num`'s speed over `den`'s round by round, with their median and 95% confidence
    interval (`intervals.ratio_ci`); None if either did not run or no round has both
    speeds."""
    if num not in timed or den not in timed:
        return None
    key = SPEEDS[speed]
    per_round = [a[key] / b[key] for a, b in zip(timed[num]["rounds"], timed[den]["rounds"],
                                                  strict=True) if a[key] and b[key]]
    if not per_round:
        return None
    return {"speed": speed, "numerator": num, "denominator": den, **ratio_ci(per_round)}


def _timed(systems: dict[str, dict]) -> dict[str, dict]:
    return {name: s for name, s in systems.items() if "rounds" in s}


def _peer_best(timed: dict[str, dict], peer: str, key: str) -> str | None:
    """The fastest of `peer`'s systems on speed `key` (median over rounds), or None."""
    theirs = [name for name in timed if name.startswith(f"{peer} ") and timed[name][key]]
    return max(theirs, key=lambda name: timed[name][key]) if theirs else None


def system_ratios(systems: dict[str, dict]) -> list[dict]:
    """The ratios the report quotes, each speed (decode, end to end) round by round, with
    their median and 95% confidence interval (`_ratio`), for each peer that ran (PEERS, in
    order): "specedge best / <peer> best", the peer's best being
    the fastest of its systems by median over rounds on that speed (recorded as
    `denominator`), and "specedge plain / <peer> plain". A ratio whose systems did not both
    run (a skipped baseline) is left out, as is a round where either speed is undefined."""
    timed = _timed(systems)
    out = []
    for peer in PEERS:
        for speed, key in SPEEDS.items():
            den = _peer_best(timed, peer, key)
            entry = den and _ratio(timed, "specedge best", den, speed)
            if entry:
                out.append({"ratio": f"specedge best / {peer} best", **entry})
        for speed in SPEEDS:
            entry = _ratio(timed, "specedge plain", f"{peer} plain", speed)
            if entry:
                out.append({"ratio": f"specedge plain / {peer} plain", **entry})
    return out


def pareto_ratios(systems: dict[str, dict]) -> list[dict]:
    """Speed at equal quality: for each peer that ran and each speed, its best system (as in
    `system_ratios`) against the fastest of ours (every "specedge ..." system: each export
    and configuration timed) whose perplexity on the same text is no higher than that
    system's, with the ratio round by round. Where none of ours is as good, the entry has
    no ratio and names our lowest perplexity instead (`numerator` None), so that a faster
    peer with a worse perplexity and a slower one with a better are both read right."""
    timed = _timed(systems)
    ours = [name for name in timed if name.startswith("specedge ")]
    out = []
    for peer in PEERS:
        for speed, key in SPEEDS.items():
            den = _peer_best(timed, peer, key)
            if den is None or not ours:
                continue
            bound = timed[den]["perplexity"]
            good = [n for n in ours if timed[n]["perplexity"] <= bound and timed[n][key]]
            entry = {"ratio": f"fastest specedge at perplexity <= {peer} best", "speed": speed,
                     "denominator": den, "denominator_perplexity": bound}
            num = max(good, key=lambda n: timed[n][key]) if good else None
            ratio = num and _ratio(timed, num, den, speed)
            if ratio:
                out.append({**entry, **ratio, "numerator_perplexity": timed[num]["perplexity"]})
            elif not good:
                lowest = min(ours, key=lambda n: timed[n]["perplexity"])
                out.append({**entry, "numerator": None, "lowest": lowest,
                            "lowest_perplexity": timed[lowest]["perplexity"]})
    return out
