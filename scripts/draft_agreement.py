"""Teacher-forced top-1 agreement of feature drafts with their target on the bench prompts.

Acceptance of a greedy draft's first token is its top-1 agreement with the target, so this
measures a draft without the runtime's timing noise: the target (fp32, transformers)
answers every prompt of bench/prompts.jsonl greedily, then each draft predicts every
answer position from the target's own features (the first draft step of
runtime/drafters.FeatureDrafter), and the script counts how often the draft's argmax is
the target's, per prompt category.

    python scripts/draft_agreement.py --drafts drafts/smollm2-135m-feature [OTHER ...]
        [--model smollm2-135m] [--limit N] [--max-new-tokens 64]

Needs the export extra (torch, transformers). Prints one line of JSON per draft.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from specedge.bench.configs import load_prompts
from specedge.export.distill import load_draft
from specedge.export.sources import load_model


def target_answers(model: str, limit: int | None, max_new_tokens: int):
    """(target, tokenizer, [(category, prompt length, ids, features, target argmax)])."""
    target, tok = load_model(model)
    features = []
    target.model.norm.register_forward_hook(lambda module, args, out: features.append(out))
    runs = []
    for p in tqdm(load_prompts(limit), desc="target answers"):
        ids = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}],
                                      add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        with torch.no_grad():
            out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            features.clear()
            target(out)
            f = features[0]
            best = (f[0] @ target.lm_head.weight.T).argmax(-1)
        runs.append((p["category"], ids.shape[1], out, f, best))
    return target, tok, runs


def agreement(draft, runs) -> dict[str, float]:
    """Share of answer positions where the draft's argmax is the target's, by category."""
    hits, count = Counter(), Counter()
    head = draft.specedge_head_ids
    for category, start, out, f, best in runs:
        with torch.no_grad():
            logits = draft.head_logits(draft.predict(out[:, 1:], f[:, :-1]))[0]
        # pair r reads (f_r, x_{r+1}) and predicts x_{r+2}, as the target's row r + 1 does;
        # the first answer token is x_start
        for r in range(start - 2, out.shape[1] - 2):
            ok = int(head[logits[r].argmax()] == best[r + 1])
            for key in (category, "all"):
                hits[key] += ok
                count[key] += 1
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
        print(json.dumps({"draft": str(path), "agreement": agreement(draft, runs)}))


if __name__ == "__main__":
    main()
