"""What users would run instead, measured on the same prompts and token budget (greedy),
with each system's perplexity on one text (`quality_text_ids`): a speed ratio means
something only between systems of comparable quality.

Each baseline is skipped, with the reason recorded, when its package is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from specedge.runtime.stats import perplexity
from specedge.runtime.text import TextCodec

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
    from specedge.export.distill.folder import is_distilled_draft, load_draft
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

    target, draft = _hf_models(bundle)
    with torch.no_grad():
        logits = target(torch.tensor([text_ids])).logits[0].float().numpy()
    quality = perplexity(logits, text_ids)  # assisted generation samples the target too

    def system(**kwargs) -> dict:
        def generate(ids: list[int]) -> int:
            with torch.no_grad():
                out = target.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                      min_new_tokens=max_new_tokens, do_sample=False,
                                      **kwargs)
            return out.shape[1] - len(ids)
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
    names = ("llama.cpp plain", "llama.cpp prompt lookup")
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

        def generate(ids: list[int]) -> int:
            llm.reset()
            for n, _ in enumerate(llm.generate(ids, top_k=1, top_p=1.0, temp=0.0,
                                               reset=True), start=1):
                if n >= max_new_tokens:
                    break
            return n

        return {"generate": generate, **shared}

    lookup = LlamaPromptLookupDecoding(num_pred_tokens=LLAMA_CPP_LOOKUP_TOKENS)
    return {names[0]: system(),
            names[1]: {**system(draft_model=lookup), "lookup_tokens": LLAMA_CPP_LOOKUP_TOKENS}}


def time_systems(systems: dict[str, dict], prompt_ids: list[list[int]],
                 progress: bool = False) -> dict[str, dict]:
    """Each system's tokens per second, end to end (prompt evaluation included), on the same
    prompt ids. A system is a dict with `generate` (prompt ids -> tokens generated) and what
    to report with it, or with `skipped`: the reason it is not timed.

    The systems take turns prompt by prompt, the first of them changing every prompt, so the
    machine's drift over the run falls on all of them alike. Run one after another (llama.cpp
    after ours), llama.cpp's ratio to ours was 0.99x and 1.54x in two runs of the same code
    within an hour. Each system generates once, untimed, to warm up. `progress` shows a bar
    on stderr, advanced once per generation.
    """
    from tqdm import tqdm

    timed = [name for name, s in systems.items() if "generate" in s]
    bar = tqdm(total=len(timed) * (len(prompt_ids) + 1), desc="systems", unit="run",
               file=sys.stderr, disable=not progress)
    for name in timed:
        systems[name]["generate"](prompt_ids[0])
        bar.update()
    totals = {name: [0, 0.0] for name in timed}
    for i, ids in enumerate(prompt_ids):
        turn = i % len(timed) if timed else 0
        for name in timed[turn:] + timed[:turn]:
            t0 = time.perf_counter()
            tokens = systems[name]["generate"](ids)
            totals[name][1] += time.perf_counter() - t0
            totals[name][0] += tokens
            bar.update()
    bar.close()
    results = {}
    for name, system in systems.items():
        results[name] = {k: v for k, v in system.items() if k != "generate"}
        if name in totals:
            tokens, seconds = totals[name]
            results[name].update(tokens=tokens, seconds=seconds,
                                 tokens_per_second=tokens / seconds)
    return results
