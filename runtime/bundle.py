"""The bundle contract shared by `export/` (writer) and `runtime/` (reader).

A bundle is a folder:

    manifest.json        this module's FORMAT_VERSION, models, tokenizer, versions
    target.onnx          target graph
    target.onnx.data     its weights, for a graph over 2 GB (protobuf's limit)
    draft.onnx           draft graph (optional; draft.onnx.data likewise)
    tokenizer.json       Hugging Face `tokenizers` file
    chat_template.jinja  (optional) the model's chat template

Every graph has the same I/O (names follow the Hugging Face / Optimum convention):

    inputs   input_ids                 int64  [B, T]
             position_ids              int64  [B, T]
             past_length               int64  [B]      valid rows in each row's cache
             logits_to_keep            int64  [1]      logits for the last N positions
             past_key_values.{i}.key   float  [B, kv_heads, C, head_dim]
             past_key_values.{i}.value float  [B, kv_heads, C, head_dim]
    outputs  logits                    float  [B, N, vocab]
             present.{i}.key           float  [B, kv_heads, T, head_dim]
             present.{i}.value         float  [B, kv_heads, T, head_dim]

B, the rows of one call (format 4, manifest: batch_rows true; B = 1 before): independent
sequences, each with its own cache slot and past_length, all with T tokens in the call. A
runtime that calls several rows pads the shorter ones and ignores what the padding
computes; a graph on GroupQueryAttention (manifest: attention "fused") takes T > 1 with
B = 1 only, which ONNX Runtime's CPU kernel requires of calls with a past; "portable" and
"batched" graphs take any B and T.

KV layout "bhsd-fixed": the runtime owns cache buffers of fixed capacity C. The graph reads
rows [0, past_length) and masks the rest; it returns only the T new rows, which the runtime
writes at [past_length, past_length + T). Rollback is lowering past_length.

KV layout "bhsd-inplace" (ONNX Runtime CPU only: attention "fused", GroupQueryAttention, or
"batched", TensorScatter and ONNX's Attention; export/graph/attention.py): the same buffers
and rollback, but each present output is its whole cache buffer, [B, kv_heads, C,
head_dim]. The runtime binds it to the same memory as the past input, and the graph writes
each row's T new rows there itself, at [past_length, past_length + T) of that row.

A bundle with a feature draft (format 2, export/drafts/feature.py) adds, after the above:

    target inputs   features_to_keep  int64  [1]      features for the last F positions
                                                      (format 3; manifest: features_to_keep
                                                      true): T while a feature draft reads
                                                      them, 0 otherwise
    target outputs  hidden_states     float  [B, F, H]  its features (manifest: features H;
                                                        format 2: F = T, no input)
    draft inputs    hidden_states_in  float  [B, T, H]  (manifest: reads_features true)
    draft outputs   hidden_states     float  [B, T, H]  its predicted next features

`features_to_keep` lets plain decoding (and drafting without the feature draft) skip the
work only the features need: a feature draft's `fuse` of several layers' outputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specedge.runtime.errors import BundleError

# A runtime reads every format up to its own (format 1: no feature-draft I/O; format 2: the
# features of every position; format 3: one row a call); the formats are listed in
# CHANGELOG.md.
FORMAT_VERSION = 4
FEATURES_IN = "hidden_states_in"
FEATURES_OUT = "hidden_states"
FEATURES_KEEP = "features_to_keep"
MANIFEST = "manifest.json"
KV_LAYOUT = "bhsd-fixed"
KV_LAYOUT_IN_PLACE = "bhsd-inplace"
KV_LAYOUTS = (KV_LAYOUT, KV_LAYOUT_IN_PLACE)
# The manifest's `attention` (export/graph/attention.py): the form that computes it.
ATTENTION_FORMS = ("portable", "fused", "batched")


def past_key_name(layer: int) -> str:
    return f"past_key_values.{layer}.key"


def past_value_name(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def present_key_name(layer: int) -> str:
    return f"present.{layer}.key"


def present_value_name(layer: int) -> str:
    return f"present.{layer}.value"


def graph_io(num_layers: int, reads_features: bool = False, writes_features: bool = False,
             keeps_features: bool = False) -> tuple[list[str], list[str]]:
    """Input and output names, in graph order (`keeps_features`: a graph with feature
    output that takes `features_to_keep`)."""
    inputs = ["input_ids", "position_ids", "past_length", "logits_to_keep"]
    outputs = ["logits"]
    for i in range(num_layers):
        inputs += [past_key_name(i), past_value_name(i)]
        outputs += [present_key_name(i), present_value_name(i)]
    inputs += [FEATURES_IN] * reads_features + [FEATURES_KEEP] * keeps_features
    return inputs, outputs + [FEATURES_OUT] * writes_features


@dataclass(frozen=True)
class ModelSpec:
    """What the runtime needs to know about one graph in the bundle."""

    path: Path
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    dtype: str
    file_size: int
    features: int = 0             # H when the graph outputs `hidden_states`, else 0
    reads_features: bool = False  # a feature draft: takes `hidden_states_in`
    kv_layout: str = KV_LAYOUT
    keeps_features: bool = False  # takes `features_to_keep` (format 3 graphs with features)
    batch_rows: bool = False      # takes B rows a call (format 4)
    # The attention's form: "portable", "fused" (GroupQueryAttention) or "batched" (ONNX's
    # Attention, in place); bundles before the field: "fused" for the in-place layout.
    attention: str = "portable"

    def io(self) -> tuple[list[str], list[str]]:
        return graph_io(self.num_layers, self.reads_features, self.features > 0,
                        self.keeps_features)


@dataclass(frozen=True)
class Bundle:
    root: Path
    manifest: dict[str, Any]
    target: ModelSpec
    draft: ModelSpec | None
    tokenizer_path: Path
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None


_MODEL_FIELDS = {"file": str, "num_layers": int, "num_kv_heads": int, "head_dim": int,
                 "vocab_size": int, "max_context": int, "dtype": str, "file_size": int,
                 "kv_layout": str}


def _bad(root: Path, what: str) -> BundleError:
    return BundleError(f"{root / MANIFEST}: {what}; re-export the bundle with `specedge export`")


def _model_spec(root: Path, role: str, entry: Any) -> ModelSpec:
    if not isinstance(entry, dict):
        raise _bad(root, f"models.{role} is not an object")
    for key, kind in _MODEL_FIELDS.items():
        value = entry.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 1):
            expected = "a positive integer" if kind is int else "a string"
            raise _bad(root, f"models.{role}.{key} must be {expected}, got {value!r}")
    if entry["kv_layout"] not in KV_LAYOUTS:
        raise BundleError(f"{root / MANIFEST}: models.{role} uses KV layout "
                          f"{entry['kv_layout']!r}; this runtime reads "
                          f"{' and '.join(map(repr, KV_LAYOUTS))}: upgrade specedge")
    path = root / entry["file"]
    if not path.is_file():
        raise BundleError(f"bundle file missing: {path}; re-export the bundle")
    if path.stat().st_size != entry["file_size"]:
        raise BundleError(f"bundle file {path} is {path.stat().st_size} bytes, the manifest "
                          f"says {entry['file_size']}: it is truncated or was replaced; "
                          "re-export the bundle")
    _check_data_file(root, role, entry)
    fields = {k: entry[k] for k in _MODEL_FIELDS if k != "file"}
    features, reads = entry.get("features", 0), entry.get("reads_features", False)
    if not isinstance(features, int) or isinstance(features, bool) or features < 0:
        raise _bad(root, f"models.{role}.features must be an integer >= 0, got {features!r}")
    if not isinstance(reads, bool) or (reads and not features):
        raise _bad(root, f"models.{role}.reads_features must be true only for a graph with "
                   f"features, got {reads!r}")
    keeps = entry.get(FEATURES_KEEP, False)
    if not isinstance(keeps, bool) or (keeps and (not features or reads)):
        raise _bad(root, f"models.{role}.{FEATURES_KEEP} must be true only for a graph that "
                   f"outputs features and reads none, got {keeps!r}")
    batch_rows = entry.get("batch_rows", False)
    if not isinstance(batch_rows, bool):
        raise _bad(root, f"models.{role}.batch_rows must be true or false, got {batch_rows!r}")
    attention = entry.get("attention", "portable" if entry["kv_layout"] == KV_LAYOUT
                          else "fused")
    if attention not in ATTENTION_FORMS:
        raise BundleError(f"{root / MANIFEST}: models.{role} has attention {attention!r}; "
                          f"this runtime reads {', '.join(map(repr, ATTENTION_FORMS))}: "
                          "upgrade specedge")
    return ModelSpec(path=path, features=features, reads_features=reads, keeps_features=keeps,
                     batch_rows=batch_rows, attention=attention, **fields)


def _check_data_file(root: Path, role: str, entry: dict) -> None:
    """A graph over 2 GB keeps its weights in a data file beside it (`data_file`, whose size
    is `data_file_size`): check it is there and whole before ONNX Runtime reads it."""
    name, size = entry.get("data_file"), entry.get("data_file_size")
    if name is None:
        return
    if not isinstance(name, str) or not isinstance(size, int) or isinstance(size, bool):
        raise _bad(root, f"models.{role}.data_file must be a file name with an integer "
                   f"data_file_size, got {name!r} and {size!r}")
    path = root / name
    if not path.is_file():
        raise BundleError(f"bundle file missing: {path} (the weights of "
                          f"{root / entry['file']}); re-export the bundle")
    if path.stat().st_size != size:
        raise BundleError(f"bundle file {path} is {path.stat().st_size} bytes, the manifest "
                          f"says {size}: it is truncated or was replaced; re-export the bundle")


def _tokenizer_entry(root: Path, tok: Any) -> dict[str, Any]:
    if not isinstance(tok, dict):
        raise _bad(root, f"tokenizer must be an object, got {tok!r}")
    for key in ("file", "chat_template", "bos_token", "eos_token"):
        if tok.get(key) is not None and not isinstance(tok[key], str):
            raise _bad(root, f"tokenizer.{key} must be a string, got {tok[key]!r}")
    eos = tok.get("eos_token_ids", [])
    if not isinstance(eos, list) or any(not isinstance(i, int) or isinstance(i, bool)
                                        for i in eos):
        raise _bad(root, f"tokenizer.eos_token_ids must be a list of integers, got {eos!r}")
    return tok


def load_bundle(root: str | Path) -> Bundle:
    """Read and validate a bundle folder; raise BundleError saying what to do if it is bad."""
    root = Path(root)
    manifest_path = root / MANIFEST
    if not root.exists():
        raise BundleError(f"the bundle folder {root} does not exist: pass a folder made by "
                          "`specedge export`, or export one there")
    if not root.is_dir():
        raise BundleError(f"{root} is a file, not a bundle folder: pass the folder made by "
                          "`specedge export` that holds it")
    if not manifest_path.is_file():
        raise BundleError(f"no {MANIFEST} in {root}: pass a folder made by `specedge export`")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{manifest_path} is not valid JSON ({e}); re-export the bundle") from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format_version"), int):
        raise BundleError(f"{manifest_path} has no integer format_version; re-export the bundle")
    version = manifest["format_version"]
    if version > FORMAT_VERSION:
        raise BundleError(f"{manifest_path} has format_version {version}, newer than this "
                          f"runtime's {FORMAT_VERSION}: upgrade specedge")
    models = manifest.get("models")
    if not isinstance(models, dict) or "target" not in models:
        raise BundleError(f"{manifest_path} lists no target model; re-export the bundle")
    target = _model_spec(root, "target", models["target"])
    draft = _model_spec(root, "draft", models["draft"]) if models.get("draft") else None
    if draft is not None and draft.reads_features and draft.features != target.features:
        raise _bad(root, f"the feature draft reads {draft.features}-wide features, the "
                   f"target outputs {target.features}")
    if draft is not None and draft.vocab_size != target.vocab_size:
        raise BundleError(f"the draft's vocabulary ({draft.vocab_size} tokens) differs from the "
                          f"target's ({target.vocab_size}): re-export with a draft that shares "
                          "the target's tokenizer")
    tok = _tokenizer_entry(root, manifest.get("tokenizer", {}))
    tokenizer_path = root / tok.get("file", "tokenizer.json")
    if not tokenizer_path.is_file():
        raise BundleError(f"bundle file missing: {tokenizer_path}; re-export the bundle")
    chat_template = None
    if tok.get("chat_template"):
        template_path = root / tok["chat_template"]
        if not template_path.is_file():
            raise BundleError(f"bundle file missing: {template_path}; re-export the bundle")
        chat_template = template_path.read_text()
    return Bundle(root=root, manifest=manifest, target=target, draft=draft,
                  tokenizer_path=tokenizer_path, chat_template=chat_template,
                  eos_token_ids=tuple(tok.get("eos_token_ids", [])),
                  bos_token=tok.get("bos_token"),
                  eos_token=tok.get("eos_token"))
