"""Teacher-forced top-1 agreement of feature drafts with their target on the bench prompts.

Acceptance of a greedy draft's first token is its top-1 agreement with the target, so this
measures a draft without the runtime's timing noise: the target answers every prompt of
specedge/prompts.jsonl greedily, with its features, as distillation's data is made
(export/distill/data.py generate_shard), and each draft is scored on those answers
as training scores it (export/distill/losses.py feature_loss: every answer position
predicted from the target's own features, the first draft step of
runtime/drafting/feature.py FeatureDrafter), per prompt category.

    python scripts/experiments/draft_agreement.py --drafts drafts/smollm2-135m-feature [OTHER ...]
        [--model smollm2-135m] [--limit N] [--max-new-tokens 64]

Needs the export extra (torch, transformers). Prints one line of JSON per draft.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from specedge.export.distill.config import DistillConfig
from specedge.export.distill.data import add_layer_features, generate_shard
from specedge.export.distill.draft_folder import load_draft
from specedge.export.distill.losses import feature_loss
from specedge.export.sources import load_model
from specedge.prompts import load_prompts


def target_answers(model: str, limit: int | None, max_new_tokens: int):
    """(target, tokenizer, [(category, example)]): greedy answers, one prompt at a time
    (no padding), as distillation's examples."""
    target, tok = load_model(model)
    cfg = DistillConfig(target=model, new_tokens=max_new_tokens)
    runs = [(p["category"], generate_shard(target, tok, [p["prompt"]], cfg, False, 0)[0])
            for p in tqdm(load_prompts(limit), desc="target answers")]
    return target, tok, runs


def agreement(draft, runs, target=None) -> dict[str, float]:
    """Share of answer positions where the draft's argmax is the target's, by category
    (`target` computes the earlier layers' outputs a draft with feature_layers reads)."""
    if getattr(draft, "feature_layers", ()):
        with tempfile.TemporaryDirectory() as work:
            add_layer_features(target, [ex for _, ex in runs], draft.feature_layers,
                               Path(work), 1)
    hits, count = Counter(), Counter()
    for category, example in runs:
        with torch.no_grad():
            share = feature_loss(draft, [example])[1]
        answer = len(example["top_ids"])
        for key in (category, "all"):
            hits[key] += share * answer
            count[key] += answer
    return {key: round(hits[key] / count[key], 3) for key in count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", type=Path, nargs="+", required=True,
                    help="feature draft folders (specedge distill --kind feature)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    target, tok, runs = target_answers(args.model, args.limit, args.max_new_tokens)
    for path in args.drafts:
        draft = load_draft(path, target, tok)
        if not hasattr(draft, "predict"):
            raise SystemExit(f"{path} is not a feature draft (specedge distill --kind feature)")
        print(json.dumps({"draft": str(path), "agreement": agreement(draft, runs, target)}))


if __name__ == "__main__":
    main()
