"""The draft folder: `specedge_draft.json` (shape, head token ids, provenance) and
`weights.safetensors` (fp16 trained weights only); loading it back onto its target."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specedge.export.drafts.feature import FeatureDraft
from specedge.export.drafts.truncated import attach_head, make_draft

DRAFT_META = "specedge_draft.json"


DRAFT_KINDS = ("model", "feature")


DRAFT_WEIGHTS = "weights.safetensors"
# The target's own modules that a draft reads, frozen: rebuilt from the target, not stored.
TARGET_PARTS = ("embed_tokens", "lm_head", "position_embed")


def is_target_part(name: str) -> bool:
    return any(part in name for part in TARGET_PARTS)


def save_draft(draft, head_ids: torch.Tensor, out: Path, meta: dict) -> dict:
    weights = {k: v.to(torch.float16).contiguous() for k, v in draft.state_dict().items()
               if not is_target_part(k)}
    save_file(weights, str(out / DRAFT_WEIGHTS))
    (out / DRAFT_WEIGHTS).chmod(0o644)
    meta = {**meta, "kind": "feature" if isinstance(draft, FeatureDraft) else "model",
            "num_layers": draft.config.num_hidden_layers,
            "mlp_width": getattr(draft.config, "intermediate_size", None),  # None: GPT-2's
            "head_token_ids": head_ids.tolist()}
    if getattr(draft, "feature_layers", ()):
        meta["feature_layers"] = list(draft.feature_layers)
    (out / DRAFT_META).write_text(json.dumps(meta, indent=1))
    return meta


def tokenizer_digest(tokenizer) -> str:
    """Identifies what token ids mean: a hash of the token -> id map."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()


def is_distilled_draft(path: str | Path) -> bool:
    return (Path(path) / DRAFT_META).is_file()


def check_distilled_draft(path: Path, target_tokenizer) -> dict:
    """The draft's metadata, or ValueError if it was made for another tokenizer."""
    try:
        meta = json.loads((path / DRAFT_META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path / DRAFT_META} ({e}); re-run specedge distill") \
            from e
    if meta.get("tokenizer_sha256") != tokenizer_digest(target_tokenizer):
        raise ValueError(f"the draft in {path} was distilled for another tokenizer "
                         f"(target {meta.get('target')!r}): speculative decoding needs a "
                         "draft with the target's tokenizer")
    if not (path / DRAFT_WEIGHTS).is_file():
        raise ValueError(f"{path / DRAFT_WEIGHTS} is missing; re-run specedge distill")
    return meta


def load_draft(path: Path, target, target_tokenizer):
    """Rebuild a distilled draft folder on the target's embeddings."""
    meta = check_distilled_draft(path, target_tokenizer)
    head_ids = torch.tensor(meta["head_token_ids"])
    if meta.get("kind", "model") == "feature":
        draft = FeatureDraft(target, head_ids, meta.get("feature_layers", ()),
                             meta.get("mlp_width"))
    else:
        draft = make_draft(target, meta["num_layers"], meta.get("mlp_width"))
        attach_head(draft, head_ids)
    load_weights(draft, path)
    return draft.eval()


def load_weights(draft, path: Path) -> None:
    """Load a draft folder's trained weights into `draft`, a draft of the same shape."""
    state = {k: v.float() for k, v in load_file(str(path / DRAFT_WEIGHTS)).items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected or not all(is_target_part(k) for k in missing):
        raise ValueError(f"{path / DRAFT_WEIGHTS} does not match its {DRAFT_META}; "
                         "re-run specedge distill")


def draft_shape(kind: str, num_layers: int, mlp_width: int | None,
                feature_layers) -> dict:
    """What a draft's trained weights are shaped by (its head tokens are not among them: the
    head is the target's, its rows chosen by the data)."""
    return {"kind": kind, "num_layers": num_layers, "mlp_width": mlp_width,
            "feature_layers": sorted(feature_layers)}


def check_init(path: Path, target_tokenizer, shape: dict) -> None:
    """ValueError unless the draft folder `path` (`distill --init`) was made for this
    target's tokenizer and has this run's `draft_shape`."""
    meta = check_distilled_draft(path, target_tokenizer)
    theirs = draft_shape(meta.get("kind", "model"), meta["num_layers"], meta.get("mlp_width"),
                         meta.get("feature_layers", []))
    if theirs != shape:
        raise ValueError(f"--init {path} is a draft of another shape ({theirs}) than this run "
                         f"makes ({shape}): give the same --kind, --layers, --mlp-width and "
                         "--feature-layers, or leave --init out")
