"""onnxruntime-genai, the closest peer (the same ONNX Runtime, the same int4 MatMulNBits),
as systems of `specedge bench`: its own models of the checkpoint the bundle was exported
from (`ort_genai_models.py`), each decoded plainly and with its n-gram speculation, greedy,
on the same prompt ids, with each model's perplexity on the same text ids.

Its Generator is driven token by token as its documentation shows: `append_tokens` runs
the prompt, each `generate_next_token` makes one token visible, until `max_new_tokens` or
its end-of-sequence token.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from specedge.bench.baselines import Generation
from specedge.bench.ort_genai_models import (
    INSTALL,
    VARIANTS,
    BuildError,
    Variant,
    built_model,
    installed_version,
)
from specedge.bench.peer_models import bundle_checkpoint
from specedge.bench.perplexity import perplexity

PEER = "onnxruntime-genai"
# Its n-gram speculation (prompt lookup: the last ngram_size - 1 tokens looked up in the
# sequence so far) at the settings the bench chose (docs/bench.md#onnxruntime-genai).
NGRAM = {"ngram_size": 3, "max_draft_tokens": 4}


def system_names(variant: Variant) -> tuple[str, str]:
    """The variant's plain and n-gram systems: "onnxruntime-genai plain", "onnxruntime-genai
    k-quant n-gram", ..."""
    prefix = f"{PEER} {variant.name} " if variant.name else f"{PEER} "
    return prefix + "plain", prefix + "n-gram"


NAMES = tuple(name for variant in VARIANTS for name in system_names(variant))


def _open(folder: Path, threads: int | None):
    """Its Model of a built folder, on `threads` intra-op threads (None: ONNX Runtime's
    choice, as ours)."""
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    if threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads}}}}))
    return og.Model(config)


def model_perplexity(model, text_ids: list[int]) -> float:
    """The perplexity of `text_ids` from the logits its own Generator returns for the prompt
    (`get_output("logits")`: a row per position, as the builder keeps the LM head over all
    of them by default, which its n-gram verification needs too)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(text_ids), do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([text_ids], dtype=np.int32))
    logits = np.asarray(generator.get_output("logits"))[0]
    if len(logits) != len(text_ids):
        raise BuildError(f"its model returned {len(logits)} rows of logits for a "
                         f"{len(text_ids)}-token text: built with a pruned LM head; delete "
                         "the model folder so that the bench builds it again")
    return perplexity(logits, text_ids)


def generate_with(model, max_new_tokens: int, speculative: dict | None):
    """`generate` (prompt ids -> Generation) of greedy decoding on `model`, with its
    speculative options `speculative` (None: plain)."""
    import onnxruntime_genai as og

    def generate(ids: list[int]) -> Generation:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + max_new_tokens, do_sample=False)
        if speculative:
            params.set_speculative_options(**speculative)
        generator = og.Generator(model, params)
        generator.append_tokens(np.asarray([ids], dtype=np.int32))  # the prompt
        n, first, first_tokens = 0, None, 1
        while n < max_new_tokens and not generator.is_done():
            generator.generate_next_token()
            n += 1
            if first is None:
                first = time.perf_counter()
                if speculative:  # tokens a first verification computed with the first one
                    first_tokens += int(generator.get_speculative_stats()["tokens_buffered"])
        end = time.perf_counter()
        return Generation(n, end - first if first is not None else 0.0, min(first_tokens, n))

    return generate


def ort_genai_systems(bundle: Path, max_new_tokens: int, threads: int | None,
                      text_ids: list[int]) -> dict:
    """Each variant's plain and n-gram systems as `baselines.time_systems` takes them, with
    its perplexity and what it ran (`model`, `version`, `variant`, `builder_options`,
    `speculative`). All are skipped, with the reason, when onnxruntime-genai is not
    installed; a variant's two, when its model cannot be built (with the builder's last
    line) or run (with its error)."""
    version = installed_version()
    if version is None:
        return dict.fromkeys(NAMES, {"skipped": f"{PEER} not installed ({INSTALL})"})
    try:
        checkpoint = bundle_checkpoint(bundle)
    except ValueError as e:
        return dict.fromkeys(NAMES, {"skipped": f"no checkpoint to build its model from: {e}"})
    systems = {}
    for variant in VARIANTS:
        plain, ngram = system_names(variant)
        try:
            folder = built_model(checkpoint, variant, version)
            model = _open(folder, threads)
            quality = model_perplexity(model, text_ids)
        except BuildError as e:
            systems.update(dict.fromkeys((plain, ngram), {"skipped": str(e)}))
            continue
        except RuntimeError as e:  # what onnxruntime-genai raises for a model it cannot run
            systems.update(dict.fromkeys((plain, ngram), {
                "skipped": f"its model in {folder} does not run here: {e}"}))
            continue
        shared = {"perplexity": quality, "model": str(folder), "version": version,
                  "variant": variant.slug, "builder_options": list(variant.extra_options)}
        systems[plain] = {"generate": generate_with(model, max_new_tokens, None), **shared}
        systems[ngram] = {"generate": generate_with(model, max_new_tokens, NGRAM),
                          **shared, "speculative": dict(NGRAM)}
    return systems

