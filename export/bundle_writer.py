"""Write a bundle: target and draft graphs, tokenizer, chat template, manifest.

The export runs as named steps (load, export, verify, quantize, write), each a function
that takes the `ExportSettings` and what the step before it produced. Everything is written
to a temporary folder beside the destination and moved into place at the end, so an
interrupted export leaves nothing half-written.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time
from contextlib import closing
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from specedge import __version__
from specedge.export.distill.draft_folder import load_draft
from specedge.export.drafts.feature import FeatureDraft
from specedge.export.drafts.truncated import (
    apply_draft_head,
    fit_draft_vocabulary,
    tokenizer_size,
    truncated_draft,
)
from specedge.export.graph.families import attention_form, model_dims_of
from specedge.export.graph.trace import BATCHED_OPSET, GRAPH_REVISION, OPSET, export_onnx
from specedge.export.model_entry import model_entry
from specedge.export.onnx_files import graph_files
from specedge.export.preflight import ExportPlan, preflight
from specedge.export.quantize import (
    BLOCK_SIZE,
    HEAD_BITS,
    PERPLEXITY_TEXT,
    quantization_report,
    quantize_graph,
)
from specedge.export.settings import HEAD_SUBSET_DRAFTS, ExportSettings, draft_kind
from specedge.export.sources import GGUF_READER_REVISION, load_model
from specedge.export.steps import ExportError, ExportRun, step_error
from specedge.export.verify import verify_failure, verify_feature_draft, verify_graph
from specedge.prompts import load_prompts
from specedge.runtime.atomic_files import replacing
from specedge.runtime.bundle import FORMAT_VERSION, MANIFEST

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

VERIFY_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
MIN_TEXT_IDS = 8  # fewer ids from the verify prompt or the perplexity text: use test ids


def text_ids(tokenizer, text: str) -> list[int]:
    """`text` in token ids, or, where the tokenizer makes fewer than MIN_TEXT_IDS ids of it
    (a tokenizer whose vocabulary has no word of this English text), ids spread over the
    tokenizer's range, so that --verify and the quality report always have a sequence to run
    (an empty one would reach torch as a float tensor)."""
    ids = list(tokenizer(text)["input_ids"])
    if len(ids) >= MIN_TEXT_IDS:
        return ids
    size = tokenizer_size(tokenizer)
    return [(7 + 31 * i) % size for i in range(max(MIN_TEXT_IDS, len(text) // 4))]


def _special_tokens(model, tokenizer) -> dict:
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    return {"eos_token_ids": sorted(eos_ids), "bos_token_id": tokenizer.bos_token_id,
            "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}


def _fingerprint(source: str | None) -> str | None:
    """Changes when a local model file or folder changes (name, size, mtime of each file)."""
    if source is None or not Path(source).exists():
        return None
    path = Path(source)
    files = sorted(p for p in ([path] if path.is_file() else path.rglob("*"))
                   if p.is_file() and "work" not in p.relative_to(path).parts[:1])
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def export_args(model: str, draft: str | None, draft_layers: int | None,
                max_context: int | None, precision: str, attention: str = "auto",
                draft_head_tokens: int | str | None = None, int4_grid: str = "exact",
                int4_block: int = BLOCK_SIZE, int4_head_bits: int = HEAD_BITS) -> dict:
    """What a bundle was made from: an up-to-date bundle has exactly these."""
    args = {"model": model, "model_fingerprint": _fingerprint(model), "draft": draft,
            "draft_fingerprint": _fingerprint(draft), "draft_layers": draft_layers,
            "max_context": max_context, "precision": precision, "attention": attention,
            "graph_revision": GRAPH_REVISION}
    # Bundles of the original int4 grid keep their arguments (and stay up to date).
    if int4_grid != "exact":
        args["int4_grid"] = int4_grid
    if (int4_block, int4_head_bits) != (BLOCK_SIZE, HEAD_BITS):
        args["int4_block"], args["int4_head_bits"] = int4_block, int4_head_bits
    # Only a truncated or checkpoint draft takes a head subset: other bundles keep their
    # arguments (and stay up to date).
    if draft_kind(draft, draft_layers) in HEAD_SUBSET_DRAFTS:
        args["draft_head_tokens"] = "auto" if draft_head_tokens is None else draft_head_tokens
    # A GGUF file is read through a config completed from its keys (export/gguf_config.py):
    # a reader that reads the same file differently makes a different model.
    if any(str(source).endswith(".gguf") for source in (model, draft) if source):
        args["gguf_reader_revision"] = GGUF_READER_REVISION
    return args


def is_current(out: Path, args: dict) -> bool:
    """True if `out` is a bundle exported with the same arguments (nothing to redo)."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return manifest.get("format_version") == FORMAT_VERSION and manifest.get("source") == args


def export_bundle(model: str, out: str | Path, draft: str | None = None,
                  draft_layers: int | None = None, max_context: int | None = None,
                  precision: str = "fp32", verify: bool = False, force: bool = False,
                  attention: str = "auto", draft_head_tokens: int | str | None = None,
                  int4_grid: str = "exact", int4_block: int = BLOCK_SIZE,
                  int4_head_bits: int = HEAD_BITS) -> dict:
    """Export `model` (and its draft) to the bundle folder `out`; returns the manifest.

    Skips the work when `out` already holds a bundle made with the same arguments, unless
    `force`. Bad arguments or input raise ValueError before any weights are loaded; a step
    that fails raises ExportError (a RuntimeError) naming the step and what to do. With
    `verify`, a graph that disagrees with transformers is an ExportError that says by how
    much (the check runs on the fp32 graphs, before quantization). A `precision` other than fp32
    quantizes both graphs and records the quantized target's agreement with fp32.
    `attention`: "fused" (GroupQueryAttention: ONNX Runtime CPU only), "batched" (ONNX's
    Attention, in place: ONNX Runtime CPU, batched decoding), "portable", or "auto"
    (batched for int8 and int4 graphs, else portable). `draft_head_tokens`: how many tokens a
    truncated or checkpoint draft's head scores, an integer, "all", or "auto"/None
    (drafts/truncated.py `draft_head_size`). `int4_grid`: how int4 holds a weight
    (export/quantize.py `INT4_GRIDS`); `int4_block` and `int4_head_bits`: its block and the
    LM head's bits (`INT4_BLOCKS`, `INT4_HEAD_BITS`). The same as `write_bundle` with these as its
    ExportSettings.
    """
    return write_bundle(ExportSettings(
        model=model, out=out, draft=draft, draft_layers=draft_layers,
        max_context=max_context, precision=precision, verify=verify, force=force,
        attention=attention, draft_head_tokens=draft_head_tokens, int4_grid=int4_grid,
        int4_block=int4_block, int4_head_bits=int4_head_bits))


def write_bundle(settings: ExportSettings) -> dict:
    """Export as `settings` say (`export_bundle` tells what that does); returns the
    manifest."""
    from transformers.utils import logging as hf_logging

    source = export_args(settings.model, settings.draft, settings.draft_layers,
                         settings.max_context, settings.precision, settings.attention,
                         settings.draft_head_tokens, settings.int4_grid, settings.int4_block,
                         settings.int4_head_bits)
    if not settings.force and is_current(settings.out, source):
        print(f"bundle {settings.out} is up to date (use --force to re-export)",
              file=sys.stderr)
        return json.loads((settings.out / MANIFEST).read_text())
    plan = preflight(settings)
    hf_logging.disable_progress_bar()  # one progress bar: ours

    progress = tqdm(total=len(_step_names(settings)), desc="export", unit="step",
                    file=sys.stderr)
    try:
        with replacing(settings.out, folder=True) as tmp, closing(progress):
            manifest = _export_steps(ExportRun(tmp, source, progress), settings, plan)
    except OSError as e:  # moving the new bundle into place
        raise step_error("write bundle", e) from e
    return manifest


def _step_names(settings: ExportSettings) -> list[str]:
    """The steps the export runs, in order (the progress bar counts them)."""
    names = ["load models", "export target graph", "export draft graph"]
    names += ["verify graphs"] if settings.verify else []
    names += ["quantize"] if settings.quantized else []
    return names + ["write bundle"]


@dataclass(frozen=True)
class _Models:
    """What the load step produces: the target, its tokenizer and special tokens
    (`_special_tokens`), and the draft (None without one)."""

    target: nn.Module
    tokenizer: PreTrainedTokenizerBase
    special: dict
    draft: nn.Module | None

    @property
    def roles(self) -> dict[str, nn.Module]:
        return {"target": self.target} | ({"draft": self.draft} if self.draft is not None else {})

    @property
    def feature_draft(self) -> bool:
        return isinstance(self.draft, FeatureDraft)

    @property
    def reader(self) -> nn.Module | bool:
        """What the target's features feed: the feature draft, or False (no features)."""
        return self.draft if self.feature_draft else False


@dataclass(frozen=True)
class _ModelFacts:
    """What the steps after verify need of the models, so that the models themselves can go:
    the tokenizer and its special tokens, each role's config, the draft head's token ids
    (None: every token), the verify prompt in token ids, and the tokens a quantizer
    calibrates on (`calibration_ids`)."""

    tokenizer: PreTrainedTokenizerBase
    special: dict
    configs: dict
    head_ids: torch.Tensor | None
    prompt: list[int]
    calibration: list[int]


@dataclass(frozen=True)
class _Graphs:
    """Each role's graph file in the bundle (`final`) and where it is traced (`fp32`): the
    same file at fp32; a quantized graph is written in fp32 first, beside the file it ends
    in, and the quantize step removes it."""

    final: dict[str, Path]
    fp32: dict[str, Path]


@dataclass(frozen=True)
class _Reports:
    """What the export measured of its graphs: each role's verify report (empty without
    --verify) and the quantized target's against fp32 (None at fp32)."""

    verify: dict
    quantization: dict | None


def _export_steps(run: ExportRun, settings: ExportSettings, plan: ExportPlan) -> dict:
    """`write_bundle`'s steps, each in `run.step`, into the temporary folder `run.folder`."""
    with run.step("load models"):
        models = _load_models(settings, plan)
    facts = _model_facts(models)
    graphs = _export_graphs(run, settings, models)
    verify = _verify_graphs(run, models, graphs, facts.prompt) if settings.verify else {}
    # Torch's copy of the weights goes, so that the quantize step holds the ONNX graphs only
    # (a 1B model's fp32 weights are 5 GB).
    del models
    gc.collect()
    reports = _Reports(verify, _quantize(run, settings, graphs, facts))
    with run.step("write bundle"):
        return _record(run, settings, facts, graphs, reports)


def _load_models(settings: ExportSettings, plan: ExportPlan) -> _Models:
    """The load step: the target and its tokenizer, and the draft, whose head scores the
    `plan.head_tokens` tokens the preflight chose (and the end-of-sequence ids)."""
    target, tokenizer = load_model(plan.target)
    special = _special_tokens(target, tokenizer)
    draft = _load_draft(settings, plan, target, tokenizer)
    if draft is not None:
        apply_draft_head(draft, tokenizer, plan.head_tokens, special["eos_token_ids"])
    return _Models(target, tokenizer, special, draft)


def _load_draft(settings: ExportSettings, plan: ExportPlan, target: nn.Module,
                tokenizer) -> nn.Module | None:
    """The draft as `settings.draft_kind` says: a distilled draft rebuilt on the target's
    embeddings, a checkpoint given the target's vocabulary size, a truncated copy of the
    target, or None."""
    if settings.draft_kind == "distilled":
        return load_draft(plan.draft, target, tokenizer)
    if settings.draft_kind == "checkpoint":
        draft = load_model(plan.draft)[0]
        fit_draft_vocabulary(draft, target.config.vocab_size, tokenizer_size(tokenizer))
        return draft
    if settings.draft_kind == "layers":
        return truncated_draft(target, settings.draft_layers)
    return None


def _model_facts(models: _Models) -> _ModelFacts:
    """What the write and quantize steps will need of `models`."""
    return _ModelFacts(tokenizer=models.tokenizer, special=models.special,
                       configs={role: m.config for role, m in models.roles.items()},
                       head_ids=getattr(models.draft, "specedge_head_ids", None),
                       prompt=text_ids(models.tokenizer, VERIFY_PROMPT),
                       calibration=calibration_ids(models.tokenizer,
                                                   models.roles["target"].config))


# Tokens of the shipped prompt set a quantizer calibrates on (not the quality report's text,
# which must stay unseen).
CALIBRATION_TOKENS = 512


def calibration_ids(tokenizer, config) -> list[int]:
    """The shipped prompts (specedge/prompts.jsonl) one after another, in token ids, cut at
    CALIBRATION_TOKENS and at the model's context."""
    text = "\n\n".join(p["prompt"] for p in load_prompts())
    limit = min(CALIBRATION_TOKENS, model_dims_of(config)["max_context"])
    return text_ids(tokenizer, text)[:limit]


def _export_graphs(run: ExportRun, settings: ExportSettings, models: _Models) -> _Graphs:
    """The export steps: each model traced to its fp32 graph."""
    final = {role: run.folder / f"{role}.onnx" for role in models.roles}
    traced = {role: run.folder / f"{role}.fp32.onnx" for role in models.roles}
    graphs = _Graphs(final, traced if settings.quantized else final)
    # Quantized graphs keep the head's own copy, so that it is quantized as a MatMul.
    share_head = settings.precision in ("fp32", "fp16")
    with run.step("export target graph"):
        export_onnx(models.target, graphs.fp32["target"], share_head=share_head,
                    features=models.reader,
                    attention=_attention(settings, models.target))
    with run.step("export draft graph"):
        if models.draft is not None:
            export_onnx(models.draft, graphs.fp32["draft"], share_head=share_head,
                        attention=_attention(settings, models.draft))
    return graphs


def _attention(settings: ExportSettings, model: nn.Module) -> str:
    return attention_form(settings.attention, settings.precision, model.config)


def _verify_graphs(run: ExportRun, models: _Models, graphs: _Graphs, prompt: list[int]) -> dict:
    """The verify step: each fp32 graph against transformers on `prompt`; a graph that
    disagrees is an ExportError that says by how much."""
    report = {}
    with run.step("verify graphs"):
        report["target"] = verify_graph(models.target, graphs.fp32["target"], prompt,
                                        features=models.reader)
        if models.draft is not None:
            check = verify_feature_draft if models.feature_draft else verify_graph
            report["draft"] = check(models.draft, graphs.fp32["draft"], prompt)
    failed = [role for role, r in report.items() if not r["ok"]]
    if failed:
        raise ExportError(" ".join(verify_failure(role, report[role]) for role in failed)
                          + " Nothing was written (a bundle already at --out is "
                          "unchanged): export without --verify to keep the graphs and "
                          "compare them yourself, and report the model's architecture "
                          "with this message.")
    return report


def _quantize(run: ExportRun, settings: ExportSettings, graphs: _Graphs,
              facts: _ModelFacts) -> dict | None:
    """The quantize step (precisions other than fp32): both graphs, and the quantized
    target's report against its fp32 graph, which then goes (None at fp32)."""
    if not settings.quantized:
        return None
    with run.step("quantize"):
        for role in facts.configs:
            quantize_graph(graphs.fp32[role], graphs.final[role], settings.precision,
                           settings.int4_grid, facts.calibration, settings.int4_block,
                           settings.int4_head_bits)
        report = quantization_report(
            graphs.fp32["target"], graphs.final["target"], model_dims_of(facts.configs["target"]),
            facts.prompt, text_ids(facts.tokenizer, PERPLEXITY_TEXT))
        for path in graphs.fp32.values():
            for file in graph_files(path):
                file.unlink()
    return report


def _record(run: ExportRun, settings: ExportSettings, facts: _ModelFacts, graphs: _Graphs,
            reports: _Reports) -> dict:
    """The write step: the tokenizer, the chat template and manifest.json; returns the
    manifest."""
    models = {role: model_entry(config, graphs.final[role], settings.max_context,
                                settings.precision)
              for role, config in facts.configs.items()}
    tokenizer = _write_tokenizer(run.folder, facts)
    manifest = {
        "format_version": FORMAT_VERSION,
        "created_by": f"specedge {__version__}",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "backend": "onnx",
        "precision": settings.precision,
        "quantization": reports.quantization,
        "source": run.source,
        "models": models,
        "tokenizer": tokenizer,
        "versions": {"torch": version("torch"), "transformers": version("transformers"),
                     "onnx": version("onnx"),
                     "opset": BATCHED_OPSET if settings.attention == "batched" else OPSET},
        "verify": reports.verify or None,
        "export_steps": run.costs,
    }
    if facts.head_ids is not None:
        models["draft"]["head_tokens"] = len(facts.head_ids)
    (run.folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def _write_tokenizer(folder: Path, facts: _ModelFacts) -> dict:
    """tokenizer.json and the chat template into `folder`; returns the manifest's
    `tokenizer` entry."""
    facts.tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"))
    entry = {"file": "tokenizer.json", **facts.special,
             "sha256": hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()}
    if facts.tokenizer.chat_template:
        (folder / "chat_template.jinja").write_text(facts.tokenizer.chat_template)
        entry["chat_template"] = "chat_template.jinja"
    return entry
