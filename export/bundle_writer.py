"""Write a bundle: target and draft graphs, tokenizer, chat template, manifest.

Everything is written to a temporary folder beside the destination and moved into place at
the end, so an interrupted export leaves nothing half-written.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time
from contextlib import closing, contextmanager
from importlib.metadata import version
from pathlib import Path

import onnx
from tqdm import tqdm

from specedge import __version__
from specedge.export.distill.folder import check_distilled_draft, is_distilled_draft, load_draft
from specedge.export.drafts.feature import FeatureDraft
from specedge.export.drafts.truncated import (
    apply_draft_head,
    check_draft_head_tokens,
    check_draft_layers,
    check_same_vocabulary,
    fit_draft_vocabulary,
    tokenizer_size,
    truncated_draft,
)
from specedge.export.graph.families import (
    SUPPORTED_ARCHITECTURES,
    fused_attention,
    model_dims_of,
)
from specedge.export.graph.trace import GRAPH_REVISION, OPSET, export_onnx
from specedge.export.onnx_files import data_file, graph_files, load_graph
from specedge.export.peak_memory import peak_mb, reset_peak
from specedge.export.quantize import (
    PERPLEXITY_TEXT,
    PRECISIONS,
    quantization_report,
    quantize_graph,
)
from specedge.export.sources import GGUF_READER_REVISION, load_model, resolve_checkpoint
from specedge.export.verify import (
    graph_features,
    graph_kv_layout,
    verify_failure,
    verify_feature_draft,
    verify_graph,
)
from specedge.runtime.bundle import (
    FEATURES_IN,
    FEATURES_OUT,
    FORMAT_VERSION,
    KV_LAYOUT_IN_PLACE,
    MANIFEST,
)
from specedge.runtime.files import replacing

VERIFY_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
MIN_TEXT_IDS = 8  # fewer ids from the verify prompt or the perplexity text: use test ids


class ExportError(RuntimeError):
    """An export step failed: the message names the step and what to do."""


# What to do when a step fails for a reason of the libraries' (torch, transformers, ONNX,
# ONNX Runtime), whose message alone does not say.
STEP_ADVICE = {
    "load models": "check that the model (and the draft) is a complete checkpoint that "
                   "transformers can load: config.json, the weights and the tokenizer files",
    "export target graph": "the model may use a feature the exporter does not handle; try "
                           "--attention portable, and report the model's architecture with "
                           "this message",
    "export draft graph": "the draft may use a feature the exporter does not handle; try "
                          "--attention portable or another draft, and report the draft's "
                          "architecture with this message",
    "verify graphs": "the graphs were exported but could not be run against transformers; "
                     "export without --verify to keep them, and report this message",
    "quantize": "export with --precision fp32 (or another precision), and report this "
                "message",
    "write bundle": "check that the folder of --out has free space and is writable",
}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


@contextmanager
def _step(progress, name: str, costs: list[dict]):
    """Run one export step: its failure becomes an ExportError naming the step, the library's
    message, and what to do (STEP_ADVICE). Interrupts and our own errors pass as they are.
    Appends the step's time and peak memory to `costs` (the manifest's `export_steps`)."""
    progress.set_postfix_str(name)
    reset_peak()
    start = time.perf_counter()
    try:
        yield
    except ExportError:
        raise
    except Exception as e:
        raise _step_error(name, e) from e
    costs.append({"step": name, "seconds": round(time.perf_counter() - start, 1),
                  "peak_rss_mb": peak_mb()})
    progress.update()


def _step_error(name: str, e: Exception) -> ExportError:
    advice = STEP_ADVICE[name]
    return ExportError(f"export step '{name}' failed: {type(e).__name__}: {_one_line(e)}. "
                       f"{advice[0].upper()}{advice[1:]}")


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


_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
           onnx.TensorProto.INT64: "int64"}


def _io_spec(graph: onnx.GraphProto, dims: dict, features: int,
             kv_layout: str) -> tuple[list[dict], list[dict]]:
    """Names and dtypes as the graph has them; shapes as the contract states them (the
    exporter leaves some static dims symbolic)."""
    kv = [1, dims["num_kv_heads"], None, dims["head_dim"]]
    in_place = kv_layout == KV_LAYOUT_IN_PLACE  # presents are the whole cache buffers
    shapes = {"input_ids": [1, "T"], "position_ids": [1, "T"], "past_length": [1],
              "logits_to_keep": [1], "logits": [1, "N", dims["vocab_size"]],
              FEATURES_IN: [1, "T", features], FEATURES_OUT: [1, "T", features]}

    def entry(v) -> dict:
        elem = v.type.tensor_type.elem_type
        rows = "C" if v.name.startswith("past") or in_place else "T"
        shape = shapes.get(v.name) or [d if d is not None else rows for d in kv]
        return {"name": v.name, "dtype": _DTYPES.get(elem, str(elem)), "shape": shape}

    return [entry(v) for v in graph.input], [entry(v) for v in graph.output]


def _model_entry(config, path: Path, max_context: int | None, precision: str) -> dict:
    dims = model_dims_of(config)
    graph = load_graph(path).graph
    features, reads = graph_features(graph)
    kv_layout = graph_kv_layout(graph)
    inputs, outputs = _io_spec(graph, dims, features, kv_layout)
    if max_context:
        dims["max_context"] = min(dims["max_context"], max_context)
    entry = {"file": path.name, "architecture": config.model_type, **dims,
             "dtype": "float32", "precision": precision, "kv_layout": kv_layout,
             "file_size": path.stat().st_size, "inputs": inputs, "outputs": outputs}
    if data_file(path).is_file():  # a graph over 2 GB keeps its weights beside it
        entry |= {"data_file": data_file(path).name,
                  "data_file_size": data_file(path).stat().st_size}
    if features:
        entry |= {"features": features, "reads_features": reads}
    return entry


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
                draft_head_tokens: int | str | None = None) -> dict:
    """What a bundle was made from: an up-to-date bundle has exactly these."""
    args = {"model": model, "model_fingerprint": _fingerprint(model), "draft": draft,
            "draft_fingerprint": _fingerprint(draft), "draft_layers": draft_layers,
            "max_context": max_context, "precision": precision, "attention": attention,
            "graph_revision": GRAPH_REVISION}
    # Only a truncated or checkpoint draft takes a head subset: other bundles keep their
    # arguments (and stay up to date).
    if draft_layers is not None or (draft is not None and not is_distilled_draft(draft)):
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


def _preflight(out: Path, model: str, draft: str | None, draft_layers: int | None,
               max_context: int | None, precision: str, attention: str,
               draft_head_tokens: int | str | None = None) -> tuple[Path, Path | None]:
    """Every check that needs no weights, before any slow work: bad input fails at once."""
    from transformers import AutoConfig, AutoTokenizer

    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, "
                         f"got {precision!r}")
    if draft is not None and draft_layers is not None:
        raise ValueError("pass --draft or --draft-layers, not both")
    if max_context is not None and (not isinstance(max_context, int) or max_context < 1):
        raise ValueError(f"--max-context must be an integer >= 1, got {max_context!r}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for the bundle")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise ValueError(f"--out {out} is a folder that is not a bundle; exporting would "
                         "replace its contents: give a new or empty folder")
    target_path = resolve_checkpoint(model)
    target_config = AutoConfig.from_pretrained(target_path)
    if target_config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {target_config.model_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    fused_attention(attention, precision, target_config)  # raises if it cannot have it
    if draft_layers is not None:
        check_draft_layers(target_config, draft_layers)
    check_draft_head_tokens(draft_head_tokens, target_config.vocab_size)
    if draft_head_tokens not in (None, "auto") and draft_layers is None and (
            draft is None or is_distilled_draft(draft)):
        raise ValueError("--draft-head-tokens applies to a draft made with --draft-layers or "
                         "given as a checkpoint with --draft; a distilled draft scores its own "
                         "head tokens")
    draft_path = None
    if draft is not None and is_distilled_draft(draft):
        draft_path = Path(draft)
        check_distilled_draft(draft_path, AutoTokenizer.from_pretrained(target_path))
    elif draft is not None:
        draft_path = resolve_checkpoint(draft)
        check_same_vocabulary(target_config, AutoTokenizer.from_pretrained(target_path),
                              AutoConfig.from_pretrained(draft_path),
                              AutoTokenizer.from_pretrained(draft_path))
    return target_path, draft_path


def export_bundle(model: str, out: str | Path, draft: str | None = None,
                  draft_layers: int | None = None, max_context: int | None = None,
                  precision: str = "fp32", verify: bool = False, force: bool = False,
                  attention: str = "auto", draft_head_tokens: int | str | None = None) -> dict:
    """Export `model` (and its draft) to the bundle folder `out`; returns the manifest.

    Skips the work when `out` already holds a bundle made with the same arguments, unless
    `force`. Bad arguments or input raise ValueError before any weights are loaded; a step
    that fails raises ExportError (a RuntimeError) naming the step and what to do. With
    `verify`, a graph that disagrees with transformers is an ExportError that says by how
    much (the check runs on the fp32 graphs, before quantization). A `precision` other than fp32
    quantizes both graphs and records the quantized target's agreement with fp32.
    `attention`: "fused" (GroupQueryAttention: ONNX Runtime CPU only), "portable", or "auto"
    (fused for int8 and int4 Llama-family graphs). `draft_head_tokens`: how many tokens a
    truncated or checkpoint draft's head scores, an integer, "all", or "auto"/None
    (drafts/truncated.py `draft_head_size`).
    """
    from transformers.utils import logging as hf_logging

    out = Path(out)
    args = export_args(model, draft, draft_layers, max_context, precision, attention,
                       draft_head_tokens)
    if not force and is_current(out, args):
        print(f"bundle {out} is up to date (use --force to re-export)", file=sys.stderr)
        return json.loads((out / MANIFEST).read_text())
    target_path, draft_path = _preflight(out, model, draft, draft_layers, max_context,
                                         precision, attention, draft_head_tokens)
    hf_logging.disable_progress_bar()  # one progress bar: ours

    steps = ["load models", "export target graph", "export draft graph"]
    steps += ["verify graphs"] if verify else []
    steps += ["quantize"] if precision != "fp32" else []
    progress = tqdm(total=len(steps) + 1, desc="export", unit="step", file=sys.stderr)
    try:
        with replacing(out, folder=True) as tmp, closing(progress):
            manifest = _export_steps(tmp, progress, args, target_path, draft_path,
                                     draft_layers, max_context, precision, verify, attention,
                                     draft_head_tokens)
    except OSError as e:  # moving the new bundle into place
        raise _step_error("write bundle", e) from e
    return manifest


def _export_steps(tmp: Path, progress, args: dict, target_path: Path, draft_path: Path | None,
                  draft_layers: int | None, max_context: int | None, precision: str,
                  verify: bool, attention: str,
                  draft_head_tokens: int | str | None = None) -> dict:
    """`export_bundle`'s steps, each in `_step`, into the temporary folder `tmp`."""
    costs: list[dict] = []
    with _step(progress, "load models", costs):
        target, tokenizer = load_model(target_path)
        draft_model = None
        if draft_path is not None and is_distilled_draft(draft_path):
            draft_model = load_draft(draft_path, target, tokenizer)
        elif draft_path is not None:
            draft_model = load_model(draft_path)[0]
            fit_draft_vocabulary(draft_model, target.config.vocab_size,
                                 tokenizer_size(tokenizer))
        elif draft_layers is not None:
            draft_model = truncated_draft(target, draft_layers)
        if draft_model is not None and not (draft_path and is_distilled_draft(draft_path)):
            apply_draft_head(draft_model, tokenizer, draft_head_tokens,
                             _special_tokens(target, tokenizer)["eos_token_ids"])

    # Quantized graphs keep the head's own copy, so that it is quantized as a MatMul.
    share_head = precision in ("fp32", "fp16")
    feature_draft = isinstance(draft_model, FeatureDraft)
    reader = draft_model if feature_draft else False  # what the target's features feed
    roles = {"target": target} | ({"draft": draft_model} if draft_model is not None else {})
    graphs = {role: tmp / f"{role}.onnx" for role in roles}
    # A quantized graph is written in fp32 first, beside the file it ends in.
    fp32 = graphs if precision == "fp32" else {
        role: tmp / f"{role}.fp32.onnx" for role in roles}
    with _step(progress, "export target graph", costs):
        export_onnx(target, fp32["target"], share_head=share_head, features=reader,
                    fused=fused_attention(attention, precision, target.config))
    with _step(progress, "export draft graph", costs):
        if draft_model is not None:
            export_onnx(draft_model, fp32["draft"], share_head=share_head,
                        fused=fused_attention(attention, precision, draft_model.config))

    report = {}
    prompt = text_ids(tokenizer, VERIFY_PROMPT)
    if verify:
        with _step(progress, "verify graphs", costs):
            report["target"] = verify_graph(target, fp32["target"], prompt, features=reader)
            if draft_model is not None:
                check = verify_feature_draft if feature_draft else verify_graph
                report["draft"] = check(draft_model, fp32["draft"], prompt)
        failed = [role for role, r in report.items() if not r["ok"]]
        if failed:
            raise ExportError(" ".join(verify_failure(role, report[role]) for role in failed)
                              + " Nothing was written (a bundle already at --out is "
                              "unchanged): export without --verify to keep the graphs and "
                              "compare them yourself, and report the model's architecture "
                              "with this message.")
    # What the rest needs of the models; then torch's copy of the weights goes, so that the
    # quantize step holds the ONNX graphs only (a 1B model's fp32 weights are 5 GB).
    configs = {role: m.config for role, m in roles.items()}
    special = _special_tokens(target, tokenizer)
    head_ids = getattr(draft_model, "specedge_head_ids", None)
    del target, draft_model, roles, reader
    gc.collect()
    quantization = None
    if precision != "fp32":
        with _step(progress, "quantize", costs):
            for role in configs:
                quantize_graph(fp32[role], graphs[role], precision)
            quantization = quantization_report(
                fp32["target"], graphs["target"], model_dims_of(configs["target"]), prompt,
                text_ids(tokenizer, PERPLEXITY_TEXT))
            for path in fp32.values():
                for file in graph_files(path):
                    file.unlink()

    with _step(progress, "write bundle", costs):
        models = {role: _model_entry(config, graphs[role], max_context, precision)
                  for role, config in configs.items()}

        tokenizer.backend_tokenizer.save(str(tmp / "tokenizer.json"))
        tok_entry = {"file": "tokenizer.json", **special,
                     "sha256": hashlib.sha256((tmp / "tokenizer.json").read_bytes()).hexdigest()}
        if tokenizer.chat_template:
            (tmp / "chat_template.jinja").write_text(tokenizer.chat_template)
            tok_entry["chat_template"] = "chat_template.jinja"
        manifest = {
            "format_version": FORMAT_VERSION,
            "created_by": f"specedge {__version__}",
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "backend": "onnx",
            "precision": precision,
            "quantization": quantization,
            "source": args,
            "models": models,
            "tokenizer": tok_entry,
            "versions": {"torch": version("torch"), "transformers": version("transformers"),
                         "onnx": version("onnx"), "opset": OPSET},
            "verify": report or None,
            "export_steps": costs,
        }
        if head_ids is not None:
            models["draft"]["head_tokens"] = len(head_ids)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest
