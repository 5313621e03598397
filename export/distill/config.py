"""The settings of one distillation run; `data_settings` are what the data depends on."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DistillConfig:
    target: str = "smollm2-135m"
    layers: int = 2
    head_tokens: int = 8192
    prompts: int = 1200
    new_tokens: int = 128
    sampled_fraction: float = 0.25
    generate_batch: int = 32
    epochs: int = 6
    batch: int = 16
    lr: float = 1e-3
    seed: int = 0
    top_k: int = 32
    kind: str = "model"  # "model": layers on tokens; "feature": export/drafts/feature.py
    varied_prompts: int = 0
    more_prompts: int = 0  # the varied set's next prompts, answered after the first ones
    self_prompts: int = 0  # requests the target writes (distill/self_prompts.py), answered last
    # A feature draft's earlier target layers (export/drafts/feature.py); not data settings:
    # their outputs are computed from the answers afterwards (add_layer_features).
    feature_layers: list[int] = field(default_factory=list)
    mlp_width: int | None = None  # neurons of each draft layer's MLP; None: the target's
    # Train on a corpus folder (corpus.py) instead of answers generated here; its first
    # shards holding at most `corpus_tokens` answer tokens (None: all of it).
    corpus: str | None = None
    corpus_tokens: int | None = None
    unroll: int = 1  # a feature draft's drafting steps unrolled in training (unroll.py)
    teacher_dtype: str = "auto"  # the target's features on a corpus (teacher.py)
    train_dtype: str = "fp32"  # "bf16": training's products in bfloat16 (autocast)
    # A distilled draft folder of the same shape whose weights training starts from (the
    # head tokens are chosen again from this run's data); None: the untrained draft.
    init: str | None = None

    DATA_FIELDS = ("target", "prompts", "new_tokens", "sampled_fraction", "generate_batch",
                   "seed", "top_k", "varied_prompts", "more_prompts", "self_prompts")

    def data_settings(self) -> dict:
        """What the generated data depends on; the rest only shapes training."""
        return {k: v for k, v in asdict(self).items() if k in self.DATA_FIELDS}
