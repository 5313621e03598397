"""Measure the new bundle's draft before it ships: a short greedy run of the shipped prompt
set with the runtime's default settings, stored in the bundle's auto_k.json
(runtime/drafting/auto_k_file.py). A Generator opened on the bundle then starts auto K from the
draft's measured acceptance per position, and on this machine from its measured costs,
instead of from a prior that a few early misses can push to plain decoding for the rest
of a short generation (docs/design.md#choosing-k-automatically)."""

from __future__ import annotations

import sys
from pathlib import Path

from specedge.prompts import load_prompts, prompt_input
from specedge.runtime import Generator
from specedge.runtime.config import GenerationConfig
from specedge.runtime.drafting import auto_k_file

NEW_TOKENS = 48


def spread(prompts: list[dict], n: int) -> list[dict]:
    """n prompts taken evenly over the set, so every category is measured."""
    step = max(1, len(prompts) // n)
    return prompts[::step][:n]


def calibrate(bundle: str | Path, prompts: int = 8, threads: int | None = None) -> Path | None:
    """Run `prompts` shipped prompts on the bundle (ONNX Runtime CPU) and store what auto K
    measured; returns the file written, or None when no prompt fits the bundle's context.
    A file that already holds this machine's costs is kept: the bundle is up to date (a
    re-export replaces the whole folder, file included)."""
    from tqdm import tqdm

    record = auto_k_file.read(Path(bundle))
    machine = auto_k_file.machine_of("ort-cpu", threads)
    if record and any(m["machine"] == machine for m in record["machines"]):
        return Path(bundle) / auto_k_file.FILE
    gen = Generator.from_bundle(bundle, "ort-cpu", threads)
    limit = gen.context_limit(GenerationConfig.of(max_new_tokens=NEW_TOKENS))
    fitting = [p for p in load_prompts() if 0 < _length(gen, p) <= limit - NEW_TOKENS]
    if not fitting:
        return None
    for p in tqdm(spread(fitting, prompts), desc="measuring the draft", unit="prompt",
                  file=sys.stderr):
        gen.generate(**prompt_input(p), max_new_tokens=NEW_TOKENS)
    return gen.save_measurements("specedge export")


def _length(gen: Generator, prompt: dict) -> int:
    """The prompt's length in tokens; 0 when this bundle's tokenizer cannot encode it (a
    word-level vocabulary can turn a prompt into no tokens at all)."""
    try:
        return len(gen.encode_prompt(**prompt_input(prompt)))
    except ValueError:
        return 0
