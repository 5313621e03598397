"""Training data: the target's answers with its top-k log-probs at every answer position,
written in shards to DIR/work so an interrupted run resumes, and the target's layer outputs
for a feature draft."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from specedge.export.distill.config import DistillConfig
from specedge.export.distill.prompts import (
    passages_from,
    training_prompts,
    varied_prompts,
)
from specedge.export.distill.self_prompts import bench_requests, self_prompts
from specedge.export.drafts.feature import decoder_stack, target_layer_outputs
from specedge.runtime.atomic_files import replacing


def generate_shard(model, tokenizer, prompts: list[str], cfg: DistillConfig,
                    sampled: bool, seed: int) -> list[dict]:
    """Target answers for `prompts` plus its top-k log-probs at every answer position."""
    tokenizer.padding_side = "left"  # a batch's answers start at one column
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                           add_generation_prompt=True, tokenize=False)
             for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    # The target's features (its final-norm output, what its head reads) at every position,
    # for a feature draft (export/drafts/feature.py); captured as generation runs them.
    features = []
    hook = decoder_stack(model).norm.register_forward_hook(
        lambda module, args, out: features.append(out.to(torch.float16)))
    try:
        with torch.no_grad():
            sampling = {"temperature": 0.7, "top_k": 0, "top_p": 1.0} if sampled else {}
            out = model.generate(**enc, max_new_tokens=cfg.new_tokens, do_sample=sampled,
                                 return_dict_in_generate=True, output_logits=True,
                                 pad_token_id=tokenizer.pad_token_id or 0, **sampling)
    finally:
        hook.remove()
    features = torch.cat(features, dim=1)  # [B, prompt width + new - 1, H]
    # Step by step, each step's logits freed once read: stacking them first would hold three
    # [B, new, V] copies (for SmolLM2 with a batch of 128, a 12.2 GB peak against 5.9 GB).
    sequences, logits, steps = out.sequences, list(out.logits), []
    del out
    while logits:
        steps.append(torch.log_softmax(logits.pop(0).float(), dim=-1).topk(cfg.top_k, dim=-1))
    top_ids = torch.stack([s.indices for s in steps], dim=1)  # [B, new, top_k]
    top_logp = torch.stack([s.values for s in steps], dim=1)
    eos = set(model.generation_config.eos_token_id
              if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    prompt_width = enc["input_ids"].shape[1]
    shard = []
    for b in range(len(prompts)):
        prompt = enc["input_ids"][b][enc["attention_mask"][b].bool()].tolist()
        answer = sequences[b, prompt_width:].tolist()
        n = next((i + 1 for i, t in enumerate(answer) if t in eos), len(answer))
        shard.append({"ids": torch.tensor(prompt + answer[:n], dtype=torch.int32),
                      "start": len(prompt) - 1,  # the position that predicts answer[0]
                      "top_ids": top_ids[b, :n].to(torch.int32),
                      "top_logp": top_logp[b, :n].to(torch.float16),
                      # every position but the last token's, which no step ran
                      "features": features[b, prompt_width - len(prompt):
                                           prompt_width + n - 1].clone()})
    return shard


def build_dataset(model, tokenizer, cfg: DistillConfig, work: Path) -> list[dict]:
    """Generate (or reload) the on-policy data, one resumable shard per batch: the template
    prompts, then the varied ones (whose passages are the template answers), then
    `more_prompts` further varied ones, then `self_prompts` target-written ones, in shards
    of their own, so that data made without the last ones is kept when they are added (see
    `distill`)."""
    data = _answers(model, tokenizer, cfg, work, training_prompts(cfg.prompts, cfg.seed), 0)
    first = -(-cfg.prompts // cfg.generate_batch)
    if cfg.varied_prompts or cfg.more_prompts:
        greedy = data[:len(data) - int(round(cfg.sampled_fraction * len(data)))]
        prompts = varied_prompts(cfg.varied_prompts + cfg.more_prompts, cfg.seed,
                                 passages_from(greedy, tokenizer))
        for chunk in (prompts[:cfg.varied_prompts], prompts[cfg.varied_prompts:]):
            if chunk:
                data += _answers(model, tokenizer, cfg, work, chunk, first)
                first += -(-len(chunk) // cfg.generate_batch)
    if cfg.self_prompts:
        requests = self_prompts(model, tokenizer, cfg.self_prompts, cfg.seed,
                                cfg.generate_batch, work, bench_requests())
        data += _answers(model, tokenizer, cfg, work, requests, first)
    return data


def _answers(model, tokenizer, cfg: DistillConfig, work: Path, prompts: list[str],
             first: int) -> list[dict]:
    """Shards `first`, `first` + 1, ... for `prompts`; the last batches sampled."""
    n_sampled = int(round(cfg.sampled_fraction * len(prompts)))
    data = []
    batches = range(0, len(prompts), cfg.generate_batch)
    for j, start in enumerate(tqdm(batches, desc="target answers", unit="batch",
                                   file=sys.stderr)):
        i = first + j
        path = work / f"data-{i:04d}.pt"
        if not path.is_file():
            chunk = prompts[start:start + cfg.generate_batch]
            shard = generate_shard(model, tokenizer, chunk, cfg, start >= len(prompts) -
                                    n_sampled, cfg.seed + i)
            with replacing(path) as tmp:
                torch.save(shard, tmp)
        data += torch.load(path)
    return data


def add_layer_features(model, data: list[dict], layers: tuple[int, ...], work: Path,
                       batch: int) -> None:
    """`ex["layer_features"]` [n, len(layers) * H] fp16: the target's outputs of decoder
    `layers` at each of the example's feature positions, teacher-forced on its ids (the
    answers are made already, so this is one forward pass, cut after the last of `layers`).
    Cached in `work` per `batch` examples, so an interrupted run resumes."""
    tag = "_".join(map(str, layers))
    chunks = range(0, len(data), batch)
    for j, start in enumerate(tqdm(chunks, desc="target layer features", unit="batch",
                                   file=sys.stderr)):
        part = data[start:start + batch]
        path = work / f"layers-{tag}-{j:04d}.pt"
        cached = torch.load(path) if path.is_file() else []
        # The last chunk grows when prompts are added to a finished run: made again then.
        if len(cached) != len(part):
            lengths = [len(ex["features"]) for ex in part]
            ids = torch.zeros(len(part), max(lengths), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, (ex, n) in enumerate(zip(part, lengths)):
                ids[b, :n], mask[b, :n] = ex["ids"][:n].long(), 1
            out = target_layer_outputs(model, ids, mask, layers)
            both = torch.cat([out[i] for i in layers], dim=-1).to(torch.float16)
            cached = [both[b, :n].clone() for b, n in enumerate(lengths)]
            with replacing(path) as tmp:
                torch.save(cached, tmp)
        for ex, f in zip(part, cached):
            ex["layer_features"] = f


def head_token_ids(data: list[dict], count: int, vocab_size: int) -> torch.Tensor:
    """The `count` tokens that the target most often ranks first, plus its answers."""
    freq = torch.zeros(vocab_size, dtype=torch.float64)
    for ex in data:
        freq.index_add_(0, ex["top_ids"][:, 0].long(), torch.ones(len(ex["top_ids"]),
                                                                 dtype=torch.float64))
        answer = ex["ids"][ex["start"] + 1:].long()
        freq.index_add_(0, answer, torch.full((len(answer),), 0.5, dtype=torch.float64))
    count = min(count, vocab_size)
    return torch.sort(torch.topk(freq, count).indices).values
