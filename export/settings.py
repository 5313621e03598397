"""What one export is asked to make: the model, the bundle folder and the flags of
`specedge export` that decide the bundle, as one frozen `ExportSettings`.

The values that need no model are checked when the settings are made; the checks that need
the model's configuration or tokenizer are the preflight's (export/preflight.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specedge.export.distill.draft_folder import is_distilled_draft
from specedge.export.quantize import (
    BLOCK_SIZE,
    HEAD_BITS,
    INT4_BLOCKS,
    INT4_GRIDS,
    INT4_HEAD_BITS,
    PRECISIONS,
)

# Drafts whose head can score a subset of the tokens (`--draft-head-tokens`): the target's
# first layers and a checkpoint. A distilled draft scores its own head tokens.
HEAD_SUBSET_DRAFTS = ("layers", "checkpoint")


def draft_kind(draft: str | None, draft_layers: int | None) -> str | None:
    """Where the draft comes from: "layers" (the target's first `draft_layers` layers),
    "distilled" (a `specedge distill` folder), "checkpoint" (a model of its own), or None
    (no draft)."""
    if draft_layers is not None:
        return "layers"
    if draft is None:
        return None
    return "distilled" if is_distilled_draft(draft) else "checkpoint"


@dataclass(frozen=True)
class ExportSettings:
    """One export: `model` to the bundle folder `out` (a path or a str), with its draft,
    precision and checks.

    `draft`: a draft checkpoint or distilled draft folder; `draft_layers`: a draft made of the
    target's first N layers (not both). `draft_head_tokens`: how many tokens a truncated or
    checkpoint draft's head scores, an integer, "all", or "auto" (None means "auto").
    `max_context`: a cap on the context recorded in the bundle. `precision`: the weights of
    both graphs. `int4_grid`: how int4 holds a weight (export/quantize.py `INT4_GRIDS`),
    `int4_block` weights a block and `int4_head_bits` the LM head's bits at int4.
    `attention`: "fused", "batched", "portable" or "auto". `verify`: compare the graphs with
    transformers. `force`: export even when `out` is up to date.
    """

    model: str
    out: Path
    draft: str | None = None
    draft_layers: int | None = None
    draft_head_tokens: int | str = "auto"
    max_context: int | None = None
    precision: str = "fp32"
    int4_grid: str = "exact"
    int4_block: int = BLOCK_SIZE
    int4_head_bits: int = HEAD_BITS
    attention: str = "auto"
    verify: bool = False
    force: bool = False
    # Where the draft comes from (`draft_kind`), decided once when the settings are made.
    draft_kind: str | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        if self.draft_head_tokens is None:
            object.__setattr__(self, "draft_head_tokens", "auto")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.precision!r}")
        if self.int4_grid not in INT4_GRIDS:
            raise ValueError(f"--int4-grid must be one of {', '.join(INT4_GRIDS)}, "
                             f"got {self.int4_grid!r}")
        if self.int4_grid != "exact" and self.precision != "int4":
            raise ValueError(f"--int4-grid {self.int4_grid} applies to --precision int4 only")
        if self.int4_block not in INT4_BLOCKS:
            raise ValueError(f"--int4-block must be one of {', '.join(map(str, INT4_BLOCKS))}, "
                             f"got {self.int4_block!r}")
        if self.int4_head_bits not in INT4_HEAD_BITS:
            raise ValueError("--int4-head-bits must be one of "
                             f"{', '.join(map(str, INT4_HEAD_BITS))}, got {self.int4_head_bits!r}")
        int4_layout = (self.int4_block, self.int4_head_bits)
        if int4_layout != (BLOCK_SIZE, HEAD_BITS) and self.precision != "int4":
            raise ValueError("--int4-block and --int4-head-bits apply to --precision int4 only")
        if self.draft is not None and self.draft_layers is not None:
            raise ValueError("pass --draft or --draft-layers, not both")
        if self.max_context is not None and (
                not isinstance(self.max_context, int) or self.max_context < 1):
            raise ValueError(f"--max-context must be an integer >= 1, got {self.max_context!r}")
        object.__setattr__(self, "draft_kind", draft_kind(self.draft, self.draft_layers))

    @property
    def head_subset(self) -> bool:
        """Whether the draft's head can score a subset of the tokens (HEAD_SUBSET_DRAFTS)."""
        return self.draft_kind in HEAD_SUBSET_DRAFTS

    @property
    def quantized(self) -> bool:
        """Whether the graphs are quantized after they are traced (in fp32)."""
        return self.precision != "fp32"
