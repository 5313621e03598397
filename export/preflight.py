"""The export's checks that need the models' configurations and tokenizers but no weights,
run before any slow work so that bad input fails at once; and what they find
(`ExportPlan`): the checkpoints' folders and how many tokens the draft's head scores."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specedge.export.distill.draft_folder import check_distilled_draft
from specedge.export.drafts.truncated import (
    check_draft_layers,
    check_same_vocabulary,
    draft_head_size,
)
from specedge.export.graph.families import SUPPORTED_ARCHITECTURES, attention_form
from specedge.export.settings import ExportSettings
from specedge.export.sources import resolve_checkpoint
from specedge.runtime.bundle import MANIFEST


@dataclass(frozen=True)
class ExportPlan:
    """What the load step reads: the target's checkpoint folder, the draft's (None for no
    draft or a draft of the target's layers), and how many tokens the draft's head scores
    (None: every one, or a draft that chooses its own)."""

    target: Path
    draft: Path | None
    head_tokens: int | None


def preflight(settings: ExportSettings) -> ExportPlan:
    """Every check that needs no weights, before any slow work: bad input fails at once."""
    from transformers import AutoConfig

    _check_out(settings.out)
    target_path = resolve_checkpoint(settings.model)
    target_config = AutoConfig.from_pretrained(target_path)
    if target_config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {target_config.model_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    # Raises if the target cannot have the attention asked for.
    attention_form(settings.attention, settings.precision, target_config)
    if settings.draft_layers is not None:
        check_draft_layers(target_config, settings.draft_layers)
    head_tokens = _head_tokens(settings, target_config.vocab_size)
    return ExportPlan(target_path, _check_draft(settings, target_path, target_config),
                      head_tokens)


def _check_out(out: Path) -> None:
    """`--out` must be a new or empty folder, or a bundle (which the export replaces)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for the bundle")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise ValueError(f"--out {out} is a folder that is not a bundle; exporting would "
                         "replace its contents: give a new or empty folder")


def _head_tokens(settings: ExportSettings, vocab_size: int) -> int | None:
    """How many tokens the draft's head scores (`draft_head_size`; None: every one), after
    checking `--draft-head-tokens` against the target's vocabulary and the draft."""
    size = draft_head_size(settings.draft_head_tokens, vocab_size)
    if settings.draft_head_tokens != "auto" and not settings.head_subset:
        raise ValueError("--draft-head-tokens applies to a draft made with --draft-layers or "
                         "given as a checkpoint with --draft; a distilled draft scores its own "
                         "head tokens")
    return size if settings.head_subset else None


def _check_draft(settings: ExportSettings, target_path: Path, target_config) -> Path | None:
    """The draft's folder, once it is known to share the target's tokenizer (None without a
    draft of its own)."""
    from transformers import AutoConfig, AutoTokenizer

    if settings.draft_kind == "distilled":
        draft_path = Path(settings.draft)
        check_distilled_draft(draft_path, AutoTokenizer.from_pretrained(target_path))
        return draft_path
    if settings.draft_kind == "checkpoint":
        draft_path = resolve_checkpoint(settings.draft)
        check_same_vocabulary(target_config, AutoTokenizer.from_pretrained(target_path),
                              AutoConfig.from_pretrained(draft_path),
                              AutoTokenizer.from_pretrained(draft_path))
        return draft_path
    return None
