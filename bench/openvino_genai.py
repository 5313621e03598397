"""OpenVINO GenAI, Intel's CPU engine, as systems of `specedge bench`: its int4 model of the
checkpoint the bundle was exported from, made by its own exporter (optimum-intel's
`optimum-cli export openvino --weight-format int4`, groups of 32 weights as our int4's
blocks), decoded plainly and with its prompt lookup, greedy, on the same prompt ids, with
its perplexity on the same text ids.

The exporter pins transformers below the version specedge's export extra takes, so it lives
in a virtual environment of its own (`bash scripts/install_openvino_exporter.sh` makes
.venv-openvino; `SPECEDGE_OPTIMUM_CLI` names another `optimum-cli`); the runtime,
openvino-genai, has no such pin and comes with the peers extra. A model is made once into
the specedge cache (peer_models.py) and reused.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

from specedge.bench.baselines import Generation
from specedge.bench.peer_models import BuildError, build_once, bundle_checkpoint, checkpoint_key
from specedge.bench.perplexity import perplexity
from specedge.export.sources import cache_dir

PEER = "openvino-genai"
NAMES = (f"{PEER} plain", f"{PEER} prompt lookup")
INSTALL = "pip install -e '.[peers]'"
EXPORTER_INSTALL = "bash scripts/install_openvino_exporter.sh"
# int4 weights in groups of 32, as our int4 blocks (and GGUF's Q4_1) are: its default of 128
# does not divide SmolLM2's 576-wide layers.
WEIGHT_FORMAT, GROUP_SIZE = "int4", 32
MODEL_FILE = "openvino_model.xml"
# Its prompt lookup at the settings the bench gives onnxruntime-genai's n-gram: the last
# max_ngram_size tokens looked up in the sequence, num_assistant_tokens proposed a step.
LOOKUP = {"num_assistant_tokens": 4, "max_ngram_size": 3}
REPO = Path(__file__).resolve().parents[1]


def installed_version() -> str | None:
    """The installed openvino-genai's version, None when it is not installed."""
    if importlib.util.find_spec("openvino_genai") is None:
        return None
    return importlib.metadata.version("openvino-genai")


def exporter() -> list[str] | None:
    """The `optimum-cli` command that makes its models: $SPECEDGE_OPTIMUM_CLI, else
    .venv-openvino's, else this Python's if optimum-intel is installed here; None if none."""
    named = os.environ.get("SPECEDGE_OPTIMUM_CLI")
    if named:
        return [named]
    beside = REPO / ".venv-openvino" / "bin" / "optimum-cli"
    if beside.is_file():
        return [str(beside)]
    if importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.intel"):
        return [sys.executable, "-m", "optimum.commands.optimum_cli"]
    return None


def export_command(cli: list[str], checkpoint: Path, out: Path) -> list[str]:
    return [*cli, "export", "openvino", "--model", str(checkpoint), "--task",
            "text-generation-with-past", "--weight-format", WEIGHT_FORMAT, "--group-size",
            str(GROUP_SIZE), str(out)]


def model_folder(checkpoint: Path, version: str) -> Path:
    """<specedge cache>/openvino-genai/<checkpoint>-int4-g32-<key>."""
    key = checkpoint_key(checkpoint, {"weight_format": WEIGHT_FORMAT,
                                      "group_size": GROUP_SIZE, "openvino-genai": version})
    return cache_dir() / PEER / f"{Path(checkpoint).name}-{WEIGHT_FORMAT}-g{GROUP_SIZE}-{key}"


def exported_model(checkpoint: Path, version: str) -> Path:
    """The folder of its model of `checkpoint`, from the cache or made into it."""
    out = model_folder(checkpoint, version)
    if (out / MODEL_FILE).is_file():
        return out
    cli = exporter()
    if cli is None:
        raise BuildError(f"no OpenVINO exporter (optimum-intel) to make its model: "
                         f"{EXPORTER_INSTALL}, or name one in SPECEDGE_OPTIMUM_CLI")
    return build_once(out, MODEL_FILE, lambda tmp, scratch: export_command(cli, checkpoint, tmp),
                      f"OpenVINO's {WEIGHT_FORMAT} model (groups of {GROUP_SIZE}) of "
                      f"{checkpoint}", f"OpenVINO's exporter failed on {checkpoint}")


def _tensor(ids: list[int]):
    import openvino as ov

    return ov.Tensor(np.asarray([ids], dtype=np.int64))


def model_perplexity(folder: Path, text_ids: list[int], threads: int | None) -> float:
    """The perplexity of `text_ids` from its model's logits for every position, the model
    run by OpenVINO itself (its stateful LLM graph: input_ids, attention_mask, position_ids,
    beam_idx)."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(folder / MODEL_FILE), "CPU", _properties(threads))
    request = compiled.create_infer_request()
    request.reset_state()
    n = len(text_ids)
    request.infer({"input_ids": np.asarray([text_ids], np.int64),
                   "attention_mask": np.ones((1, n), np.int64),
                   "position_ids": np.arange(n, dtype=np.int64)[None],
                   "beam_idx": np.zeros(1, np.int32)})
    logits = np.asarray(request.get_tensor("logits").data)[0]
    if len(logits) != n:
        raise BuildError(f"its model returned {len(logits)} rows of logits for a {n}-token "
                         "text: made to keep the last position's only")
    return perplexity(logits, text_ids)


def _properties(threads: int | None) -> dict:
    return {"INFERENCE_NUM_THREADS": threads} if threads else {}


def generate_with(pipeline, max_new_tokens: int, lookup: dict | None):
    """`generate` (prompt ids -> Generation) of greedy decoding on an LLMPipeline, with its
    prompt lookup settings `lookup` (None: plain). Decode time is the pipeline's own: its
    generate duration less its time to the first token."""
    import openvino_genai as og

    def generate(ids: list[int]) -> Generation:
        config = og.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        for name, value in (lookup or {}).items():
            setattr(config, name, value)
        result = pipeline.generate(og.TokenizedInputs(_tensor(ids), _tensor([1] * len(ids))),
                                   config)
        metrics = result.perf_metrics
        decode_ms = metrics.get_generate_duration().mean - metrics.get_ttft().mean
        return Generation(len(result.tokens[0]), max(decode_ms, 0.0) / 1000)

    return generate


def openvino_systems(bundle: Path, max_new_tokens: int, threads: int | None,
                     text_ids: list[int]) -> dict:
    """Its plain and prompt-lookup systems as `baselines.time_systems` takes them, with its
    perplexity and what it ran (`model`, `version`, `weights`, `lookup`); both skipped with
    the reason when openvino-genai is not installed, no exporter is, or its model cannot be
    made or run."""
    version = installed_version()
    if version is None:
        return dict.fromkeys(NAMES, {"skipped": f"{PEER} not installed ({INSTALL})"})
    folder = None
    try:
        checkpoint = bundle_checkpoint(bundle)
        folder = exported_model(checkpoint, version)
        quality = model_perplexity(folder, text_ids, threads)
        import openvino_genai as og

        plain = og.LLMPipeline(str(folder), "CPU", **_properties(threads))
        lookup = og.LLMPipeline(str(folder), "CPU", prompt_lookup=True, **_properties(threads))
    except (ValueError, BuildError) as e:
        return dict.fromkeys(NAMES, {"skipped": str(e)})
    except RuntimeError as e:  # what OpenVINO raises for a model it cannot run
        return dict.fromkeys(NAMES, {"skipped": f"its model in {folder} does not run here: {e}"})
    shared = {"perplexity": quality, "model": str(folder), "version": version,
              "weights": f"{WEIGHT_FORMAT}, groups of {GROUP_SIZE}"}
    return {NAMES[0]: {"generate": generate_with(plain, max_new_tokens, None), **shared},
            NAMES[1]: {"generate": generate_with(lookup, max_new_tokens, LOOKUP), **shared,
                       "lookup": dict(LOOKUP)}}
