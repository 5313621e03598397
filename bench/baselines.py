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
    from specedge.export.distill import is_distilled_draft, load_draft
    from specedge.export.draft import truncated_draft
    from specedge.export.feature_draft import FeatureDraft
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


def run_transformers(bundle: Path, prompt_ids: list[list[int]], max_new_tokens: int,
                     text_ids: list[int]) -> dict:
    """transformers plain greedy and assisted generation (the bundle's draft as assistant)."""
    if importlib.util.find_spec("torch") is None:
        return {"skipped": "torch / transformers not installed (pip install -e '.[export]')"}
    import torch

    target, draft = _hf_models(bundle)
    with torch.no_grad():
        logits = target(torch.tensor([text_ids])).logits[0].float().numpy()
    results = {}
    for name, assistant in (("transformers plain", None), ("transformers assisted", draft)):
        if name.endswith("assisted") and assistant is None:
            results[name] = {"skipped": "the bundle has no draft that transformers can run "
                                        "(a feature draft reads the target's features)"}
            continue
        tokens, seconds = 0, 0.0
        for ids in prompt_ids:
            kwargs = {"assistant_model": assistant} if assistant is not None else {}
            with torch.no_grad():
                t0 = time.perf_counter()
                out = target.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                      min_new_tokens=max_new_tokens, do_sample=False, **kwargs)
                seconds += time.perf_counter() - t0
            tokens += out.shape[1] - len(ids)
        results[name] = {"tokens": tokens, "seconds": seconds,
                         "tokens_per_second": tokens / seconds,
                         "perplexity": perplexity(logits, text_ids)}
    return results


def _llama_cpp_batch(gguf: Path, threads: int) -> int:
    """512 when llama.cpp evaluates a multi-token batch on this CPU, else 1. On some CPUs
    (a build with native CPU features) such a batch crashes the process (DESIGN.md), so it
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


def run_llama_cpp(gguf: Path | None, prompt_ids: list[list[int]], max_new_tokens: int,
                  threads: int, text_ids: list[int]) -> dict:
    """llama.cpp (llama-cpp-python) plain greedy decoding on the GGUF, timed end to end
    (prompt evaluation included) like the other systems."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {"llama.cpp plain": {"skipped": "llama-cpp-python not installed "
                                               "(bash scripts/install_llama_cpp.sh)"}}
    if gguf is None:
        return {"llama.cpp plain": {"skipped": "no GGUF for this bundle"}}
    from llama_cpp import Llama

    n_batch = _llama_cpp_batch(gguf, threads)
    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_batch=n_batch,
                verbose=False)
    tokens, seconds = 0, 0.0
    for ids in prompt_ids:
        llm.reset()
        t0 = time.perf_counter()
        for n, _ in enumerate(llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True),
                              start=1):
            if n >= max_new_tokens:
                break
        seconds += time.perf_counter() - t0
        tokens += n
    del llm
    # Every position's logits, for the perplexity: slower, so not in the timed instance.
    llm = Llama(model_path=str(gguf), n_ctx=len(text_ids), n_threads=threads,
                n_batch=n_batch, logits_all=True, verbose=False)
    llm.eval(text_ids)
    logits = np.asarray(llm.scores[:len(text_ids)])
    return {"llama.cpp plain": {"tokens": tokens, "seconds": seconds,
                                "tokens_per_second": tokens / seconds, "n_batch": n_batch,
                                "perplexity": perplexity(logits, text_ids)}}
