"""What one training step of a feature draft on a corpus costs: positions a second of
`corpus_feature_loss` and its backward pass, at each unrolled step count, in float32 and under
bfloat16 autocast (`distill --train-dtype`), on a batch of random rows shaped like a corpus'
(the features are random: the cost does not depend on them). Interleaved rounds.

    python scripts/experiments/bench_distill_step.py [--model smollm2-135m]
        [--feature-layers 2 15] [--head-tokens 8192] [--rows 8] [--length 320]
        [--steps 1 3] [--rounds 3] [--threads 2]

Needs the export extra (torch, transformers). Prints one line per setting: the median and
range of its rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specedge.export.distill.losses import corpus_feature_loss
from specedge.export.drafts.feature import FeatureDraft
from specedge.export.sources import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--feature-layers", type=int, nargs="*", default=[2, 15])
    ap.add_argument("--head-tokens", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=320)
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, _ = load_model(args.model)
    hidden = target.config.hidden_size
    draft = FeatureDraft(target, torch.arange(args.head_tokens), tuple(args.feature_layers))
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    start = args.length // 5  # a prompt of a fifth of the row, as in the corpus
    batch = [{"ids": torch.randint(0, args.head_tokens, (args.length + 1,), dtype=torch.int32),
              "start": start, "answer": args.length - start,
              "features": torch.randn(args.length, hidden).half(),
              "layer_features": torch.randn(args.length,
                                            len(args.feature_layers) * hidden).half()}
             for _ in range(args.rows)]
    settings = [(dtype, steps) for dtype in ("fp32", "bf16") for steps in args.steps]
    rates: dict[tuple[str, int], list[float]] = {s: [] for s in settings}
    for _ in range(args.rounds + 1):  # the first round warms up, and is not counted
        for dtype, steps in settings:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss, _ = corpus_feature_loss(draft, batch, steps)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rates[(dtype, steps)].append(args.rows * args.length / (time.perf_counter() - t0))
    for (dtype, steps), r in rates.items():
        r = r[1:]
        print(f"{dtype} unroll {steps}: {statistics.median(r):.0f} positions/s "
              f"[{min(r):.0f}-{max(r):.0f}] over {len(r)} rounds")


if __name__ == "__main__":
    main()
