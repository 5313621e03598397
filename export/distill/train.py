"""`specedge distill`: train a small draft on text the target itself generates.

On-policy distillation: the target answers a few hundred prompts (greedy for most, sampled
at temperature 0.7 for some, so the draft also sees the target's less likely paths) and its
top-32 next-token log-probabilities are kept at every answer position. The draft learns to
match them (cross-entropy against the target's renormalised top-32), which is what makes
its proposals pass the acceptance test: greedy acceptance needs argmax q == argmax p, and
sampled acceptance is sum_x min(p(x), q(x)) = 1 - TV(p, q).

The draft is cheap by construction:
* the target's embedding table, frozen, reused as input embedding (not stored);
* a few decoder layers of the target's width, initialised from the target's first layers
  (their inputs are the embeddings, as in the draft; later layers expect deeper features);
* an output head over the `head_tokens` most frequent answer tokens only (rows of the
  embedding table); other tokens get q = 0, which the exact acceptance rule handles.

`--kind feature` trains a feature draft instead (export/drafts/feature.py): one layer that
reads the target's features, which are recorded with the answers.

A draft folder holds `specedge_draft.json` (shape, head token ids, provenance) and
`weights.safetensors` (fp16, decoder layers and final norm only). `specedge export
--draft DIR` rebuilds it on the target's embeddings. Data, checkpoints and the training
state live in DIR/work, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from specedge.export.distill.config import DistillConfig
from specedge.export.distill.corpus import answer_tokens, read_meta, read_shards, summary
from specedge.export.distill.data import (
    add_layer_features,
    build_dataset,
    head_token_ids,
)
from specedge.export.distill.draft_folder import (
    DRAFT_KINDS,
    check_init,
    draft_shape,
    is_target_part,
    load_weights,
    save_draft,
    tokenizer_digest,
)
from specedge.export.distill.losses import corpus_feature_loss, draft_loss
from specedge.export.distill.teacher import (
    answer_head_ids,
    corpus_examples,
    teacher_cache,
    teacher_dtype,
)
from specedge.export.drafts.feature import (
    FeatureDraft,
    check_feature_layers,
    check_feature_target,
)
from specedge.export.drafts.truncated import attach_head, check_mlp_width, make_draft
from specedge.runtime.atomic_files import replacing


def new_draft(target, cfg: DistillConfig, head_ids: torch.Tensor):
    """The draft that `cfg` describes, scoring `head_ids`: untrained, or with the weights of
    the draft folder `cfg.init`."""
    if cfg.kind == "feature":
        draft = FeatureDraft(target, head_ids, cfg.feature_layers, cfg.mlp_width)
    else:
        draft = make_draft(target, cfg.layers, cfg.mlp_width)
        attach_head(draft, head_ids)
    if cfg.init:
        load_weights(draft, Path(cfg.init))
    return draft


def check_init_early(cfg: DistillConfig, target, tokenizer) -> None:
    """Before the answers or the teacher's pass, which can take hours: `cfg.init` must be a
    draft of the shape this run makes."""
    if cfg.init:
        check_init(Path(cfg.init), tokenizer, draft_shape(
            cfg.kind, 1 if cfg.kind == "feature" else cfg.layers,
            cfg.mlp_width or getattr(target.config, "intermediate_size", None),
            check_feature_layers(cfg.feature_layers, target.config.num_hidden_layers)))


def train(draft, head_ids: torch.Tensor, data: list[dict], cfg: DistillConfig,
          work: Path) -> dict:
    """AdamW with cosine decay; checkpoints every 50 steps and resumes from the last."""
    rng = random.Random(cfg.seed)
    # Indices, not examples: a corpus' examples are read from disk when a batch needs them.
    val = list(range(0, len(data), 20))
    train_set = [i for i in range(len(data)) if i % 20]
    steps_per_epoch = math.ceil(len(train_set) / cfg.batch)
    total_steps = steps_per_epoch * cfg.epochs
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / total_steps)))
    state_path, step = work / "train.pt", 0
    if state_path.is_file():
        state = torch.load(state_path)
        draft.load_state_dict(state["draft"], strict=False)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step = state["step"]
    orders = []
    for _ in range(cfg.epochs):
        order = list(range(len(train_set)))
        rng.shuffle(order)
        orders += [order[i:i + cfg.batch] for i in range(0, len(order), cfg.batch)]
    bar = tqdm(total=total_steps, initial=step, desc="train draft", unit="step",
               file=sys.stderr)
    draft.train()
    while step < total_steps:
        # bf16: the products in bfloat16 under autocast, the weights and the optimizer's
        # state in float32 (about 1.1-1.7x the steps a second on AVX-512 BF16 here).
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train_dtype == "bf16"):
            loss, agree = draft_loss(draft, head_ids,
                                     [data[train_set[i]] for i in orders[step]], cfg.unroll)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{agree:.2f}")
        if step % 50 == 0 or step == total_steps:
            trainable = {k: v for k, v in draft.state_dict().items()
                         if not is_target_part(k)}
            with replacing(state_path) as tmp:
                torch.save({"draft": trainable, "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": step}, tmp)
    bar.close()
    draft.eval()
    report = {"train_sequences": len(train_set), "val_sequences": len(val),
              "steps": total_steps}
    with torch.no_grad():
        batches = ([data[j] for j in val[i:i + cfg.batch]] for i in
                   range(0, len(val), cfg.batch))  # read from disk one at a time
        if isinstance(draft, FeatureDraft) and "top_ids" not in data[val[0]]:
            # Agreement at each drafting step (unroll.py), at least three, from r0 = r - j.
            steps = max(3, cfg.unroll)
            losses = [corpus_feature_loss(draft, batch, steps) for batch in batches]
            report["val_step_agreement"] = [
                sum(x[1][j] for x in losses) / len(losses) for j in range(steps)]
            losses = [(loss, agree[0]) for loss, agree in losses]
        else:
            losses = [draft_loss(draft, head_ids, batch) for batch in batches]
    return {"val_loss": sum(x[0].item() for x in losses) / len(losses),
            "val_top1_agreement": sum(x[1] for x in losses) / len(losses), **report}


# Targets a model draft (export/drafts/truncated.py) is distilled for.
MODEL_DRAFT_TARGETS = ("llama", "mistral", "qwen2")


def check_distill_target(config, kind: str) -> None:
    """ValueError unless `distill --kind kind` takes this target."""
    if kind == "feature":
        check_feature_target(config)
    elif config.model_type not in MODEL_DRAFT_TARGETS:
        raise ValueError(f"distill --kind model takes {', '.join(MODEL_DRAFT_TARGETS)} "
                         f"targets, not {config.model_type!r}; --kind feature takes more")


def _fresh_training_state(work: Path, cfg: DistillConfig) -> None:
    """Drop the training state if it was made with other settings (training starts over on
    the same data)."""
    run_path = work / "settings.json"
    if run_path.is_file() and {**asdict(DistillConfig()),
                               **json.loads(run_path.read_text())} != asdict(cfg):
        (work / "train.pt").unlink(missing_ok=True)
    run_path.write_text(json.dumps(asdict(cfg), indent=1))


def _distill_on_corpus(out: Path, work: Path, cfg: DistillConfig) -> dict:
    """`distill` on a corpus folder: its answers, the target's features recomputed by
    teacher forcing (teacher.py, cached in the specedge cache), a head over the tokens the
    answers use most."""
    from specedge.export.sources import load_model

    shards = read_shards(cfg.corpus, cfg.corpus_tokens)
    corpus_meta = read_meta(Path(cfg.corpus))
    _fresh_training_state(work, cfg)
    torch.manual_seed(cfg.seed)
    target, tokenizer = load_model(cfg.target)
    check_distill_target(target.config, cfg.kind)
    if corpus_meta["tokenizer_sha256"] != tokenizer_digest(tokenizer):
        raise ValueError(f"the corpus {cfg.corpus} was made by a target with another "
                         f"tokenizer ({corpus_meta['target']!r}), not {cfg.target!r}")
    check_feature_layers(cfg.feature_layers, target.config.num_hidden_layers)
    check_mlp_width(target.config, cfg.mlp_width)
    check_init_early(cfg, target, tokenizer)
    t0 = time.time()
    rows = [r for shard in shards for r in shard]
    head_ids = answer_head_ids(rows, cfg.head_tokens, target.config.vocab_size)
    draft = new_draft(target, cfg, head_ids)
    data = corpus_examples(target, shards, tuple(getattr(draft, "feature_layers", ())),
                           teacher_cache(cfg.target), dtype=teacher_dtype(cfg.teacher_dtype))
    report = train(draft, head_ids, data, cfg, work)
    meta = {"target": cfg.target, "tokenizer_sha256": tokenizer_digest(tokenizer),
            "config": asdict(cfg), "report": report, "seconds": round(time.time() - t0),
            "answer_tokens": answer_tokens(rows), "corpus": summary(rows)}
    return save_draft(draft, head_ids, out, meta)


def distill(out: str | Path, cfg: DistillConfig) -> dict:
    """Run (or resume) the whole distillation; returns the draft's metadata."""
    from specedge.export.sources import load_model

    if min(cfg.layers, cfg.head_tokens, cfg.prompts, cfg.epochs, cfg.generate_batch) < 1:
        raise ValueError("--layers, --head-tokens, --prompts, --epochs and --generate-batch "
                         "must be >= 1")
    if min(cfg.varied_prompts, cfg.more_prompts, cfg.self_prompts) < 0:
        raise ValueError("--varied-prompts, --more-prompts and --self-prompts must be >= 0, "
                         f"got {cfg.varied_prompts}, {cfg.more_prompts} and {cfg.self_prompts}")
    if cfg.kind not in DRAFT_KINDS:
        raise ValueError(f"--kind must be one of {', '.join(DRAFT_KINDS)}, got {cfg.kind!r}")
    if cfg.feature_layers and cfg.kind != "feature":
        raise ValueError("--feature-layers is for --kind feature drafts")
    if cfg.train_dtype not in ("fp32", "bf16"):
        raise ValueError(f"--train-dtype must be fp32 or bf16, got {cfg.train_dtype!r}")
    if cfg.unroll < 1 or (cfg.unroll > 1 and (cfg.kind != "feature" or not cfg.corpus)):
        raise ValueError("--unroll takes a step count >= 1; more than 1 is for --kind feature "
                         "drafts trained on a --corpus")
    out = Path(out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if cfg.corpus:
        return _distill_on_corpus(out, work, cfg)
    # Generated data is reused only for the same data settings; a training state only for
    # the same settings altogether (otherwise training starts over on the cached data).
    # Data made without --self-prompts (or without both --more-prompts and --self-prompts)
    # may gain them: their shards come last. A setting missing from a saved settings file
    # reads as its default, which is how data and states without it were made.
    data_path = work / "data-settings.json"
    if data_path.is_file():
        made = {**DistillConfig().data_settings(), **json.loads(data_path.read_text())}
        now = cfg.data_settings()
        if made not in (now, {**now, "self_prompts": 0},
                        {**now, "more_prompts": 0, "self_prompts": 0}):
            raise ValueError(f"{work} holds data generated with other settings; use another "
                             "--out or delete it")
    data_path.write_text(json.dumps(cfg.data_settings(), indent=1))
    _fresh_training_state(work, cfg)
    torch.manual_seed(cfg.seed)
    target, tokenizer = load_model(cfg.target)
    check_distill_target(target.config, cfg.kind)
    # Before the answers, which can take hours, rather than when the draft is built.
    check_feature_layers(cfg.feature_layers, target.config.num_hidden_layers)
    check_mlp_width(target.config, cfg.mlp_width)
    check_init_early(cfg, target, tokenizer)
    t0 = time.time()
    data = build_dataset(target, tokenizer, cfg, work)
    head_ids = head_token_ids(data, cfg.head_tokens, target.config.vocab_size)
    if cfg.kind == "feature" and any("features" not in ex for ex in data):
        raise ValueError(f"{work} holds data generated without the target's features "
                         "(an older specedge): delete it, or use another --out")
    draft = new_draft(target, cfg, head_ids)
    if cfg.feature_layers:
        add_layer_features(target, data, draft.feature_layers, work, cfg.generate_batch)
    report = train(draft, head_ids, data, cfg, work)
    meta = {"target": cfg.target, "tokenizer_sha256": tokenizer_digest(tokenizer),
            "config": asdict(cfg), "report": report, "seconds": round(time.time() - t0),
            "answer_tokens": sum(len(ex["top_ids"]) for ex in data)}
    return save_draft(draft, head_ids, out, meta)
