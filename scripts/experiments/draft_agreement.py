"""Teacher-forced top-1 agreement of feature drafts with their target on held-out prompts.

Acceptance of a greedy draft's first token is its top-1 agreement with the target, so this
measures a draft without the runtime's timing noise: the target answers every prompt of
specedge/prompts.jsonl greedily, with its features, as distillation's data is made
(export/distill/data.py generate_shard), and each draft is scored on those answers
as training scores it (export/distill/losses.py feature_loss: every answer position
predicted from the target's own features, the first draft step of
runtime/drafting/feature.py FeatureDrafter), per prompt category.

With `--steps N` it also scores drafting steps 2..N (export/distill/unroll.py): step j's
argmax from r0 = r - j, its own predicted features after the target's, against the target's
greedy answer token. On greedy answers that is the acceptance of draft token j + 1 given that
tokens 1..j were accepted, the per-position acceptance the runtime reports, without the
runtime's timing noise.

    python scripts/experiments/draft_agreement.py --drafts drafts/smollm2-135m-feature [OTHER ...]
        [--model smollm2-135m] [--prompts docs/examples/prompts.jsonl] [--limit N]
        [--max-new-tokens 64] [--steps 3]

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
from specedge.export.distill.unroll import unrolled_predictions
from specedge.export.graph.outputs import target_features
from specedge.export.sources import load_model
from specedge.prompts import load_prompts, read_prompt_file


def target_answers(model: str, limit: int | None, max_new_tokens: int,
                   prompts: Path | None = None):
    """(target, tokenizer, [(category, example)]): greedy answers, one prompt at a time
    (no padding), as distillation's examples; the bench prompts unless `prompts` names a
    prompt file."""
    target, tok = load_model(model)
    cfg = DistillConfig(target=model, new_tokens=max_new_tokens)
    chosen = read_prompt_file(prompts)[:limit] if prompts else load_prompts(limit)
    runs = [(p["category"], generate_shard(target, tok, [p["prompt"]], cfg, False, 0)[0])
            for p in tqdm(chosen, desc="target answers")]
    return target, tok, runs


def step_agreement(draft, runs, steps: int) -> list[float]:
    """Share of answer positions (past step j's start) where drafting step j + 1's argmax is
    the target's greedy answer token, for j = 0 .. steps - 1, over all runs."""
    hits, count = [0] * steps, [0] * steps
    for _, ex in runs:
        n, start, answer = len(ex["features"]), ex["start"], len(ex["top_ids"])
        ids = ex["ids"][1:n + 1].long().unsqueeze(0)
        layers = ex.get("layer_features")
        outputs = list(layers.float().split(draft.config.hidden_size, dim=-1)) \
            if layers is not None else []
        with torch.no_grad():
            features = target_features(getattr(draft, "fuse", None),
                                       [o.unsqueeze(0) for o in outputs],
                                       ex["features"].float().unsqueeze(0))
            outs = unrolled_predictions(draft, ids, features, steps)
        truth = ex["ids"][start + 1:start + 1 + answer].long()
        for j, out in enumerate(outs):
            # pair start - 1 + i predicts answer token i; step j needs i >= j
            picks = draft.specedge_head_ids[draft.head_logits(
                out[0, start - 1 + j:start - 1 + answer]).argmax(-1)]
            hits[j] += int((picks == truth[j:]).sum())
            count[j] += max(answer - j, 0)
    return [round(h / max(c, 1), 3) for h, c in zip(hits, count)]


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
    ap.add_argument("--prompts", type=Path, default=None,
                    help="a prompt file (JSON Lines) instead of the bench prompts, e.g. "
                    "docs/examples/prompts.jsonl")
    ap.add_argument("--steps", type=int, default=1,
                    help="also score drafting steps 2..N (default 1: the first only)")
    args = ap.parse_args()
    target, tok, runs = target_answers(args.model, args.limit, args.max_new_tokens,
                                       args.prompts)
    for path in args.drafts:
        draft = load_draft(path, target, tok)
        if not hasattr(draft, "predict"):
            raise SystemExit(f"{path} is not a feature draft (specedge distill --kind feature)")
        line = {"draft": str(path), "agreement": agreement(draft, runs, target)}
        if args.steps > 1:
            line["step_agreement"] = step_agreement(draft, runs, args.steps)
        print(json.dumps(line))


if __name__ == "__main__":
    main()
