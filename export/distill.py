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

`--kind feature` trains a feature draft instead (export/feature_draft.py): one layer that
reads the target's features, which are recorded with the answers.

A draft folder holds `specedge_draft.json` (shape, head token ids, provenance) and
`weights.safetensors` (fp16, decoder layers and final norm only). `specedge export
--draft DIR` rebuilds it on the target's embeddings. Data, checkpoints and the training
state live in DIR/work, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from .draft import check_mlp_width, copy_layer
from .feature_draft import (
    FeatureDraft,
    check_feature_layers,
    feature_loss,
    target_layer_outputs,
)
from .self_prompts import bench_requests, self_prompts

DRAFT_META = "specedge_draft.json"
DRAFT_KINDS = ("model", "feature")
DRAFT_WEIGHTS = "weights.safetensors"

# Topics of the bench prompts (bench/prompts.jsonl) are left out, so the bench measures the
# draft on prompts it has not seen.
TOPICS = [
    "volcanoes", "the French Revolution", "photosynthesis", "black holes",
    "the stock market", "machine learning", "the Roman Empire", "climate change", "coffee",
    "the human heart", "electric cars", "the internet", "chess", "vaccines", "the moon",
    "jazz music", "rainforests", "earthquakes", "the printing press", "bread baking",
    "the Olympic Games", "solar panels", "dinosaurs", "the immune system", "Shakespeare",
    "recycling", "the water cycle", "ancient Egypt", "gravity", "antibiotics",
    "the Great Wall of China", "cloud computing", "meditation", "the Amazon river", "glaciers",
    "the periodic table", "democracy", "octopuses", "renewable energy", "the Renaissance",
    "public speaking", "time management", "healthy eating", "learning a language", "DNA",
    "airplanes", "the ocean tides", "money", "friendship", "mountains",
    "the camera", "volunteering", "traffic lights", "the violin", "deserts", "penguins", "tea",
    "rivers", "the telephone", "smartphones", "batteries", "wind turbines",
    "nuclear power", "the human brain", "memory", "dreams", "exercise", "yoga",
    "football", "basketball", "tennis", "swimming", "cycling", "photography", "painting",
    "sculpture", "poetry", "novels", "theaters", "movies",
    "television", "radio", "newspapers", "podcasts", "video games", "board games", "puzzles",
    "mathematics", "prime numbers", "geometry", "statistics", "probability", "algebra",
    "calculus", "physics", "chemistry", "biology", "astronomy", "the solar system", "Mars",
    "Jupiter", "comets", "satellites", "rockets", "the space station",
    "hurricanes", "tornadoes", "snow", "rain", "lightning", "rainbows", "clouds", "forests",
    "trees", "flowers", "mushrooms", "insects", "butterflies", "ants", "spiders",
    "owls", "eagles", "whales", "dolphins", "sharks", "coral reefs", "elephants", "lions",
    "wolves", "horses", "dogs", "farming", "rice", "wheat", "chocolate", "cheese",
    "pizza", "soup", "spices", "cooking", "kitchens", "restaurants", "markets", "shopping",
    "advertising", "banks", "taxes", "budgets", "saving money", "jobs", "interviews",
    "teamwork", "leadership", "negotiation", "email etiquette", "writing essays",
    "note taking", "exams", "homework", "teachers", "universities",
    "online courses", "history", "archaeology", "maps", "travel", "trains", "ships", "cars",
    "roads", "cities", "villages", "architecture", "houses", "furniture", "clothing",
    "fashion", "shoes", "textiles", "plastic", "glass", "steel", "wood", "paper", "ink",
    "computers", "programming", "databases", "web browsers", "passwords", "encryption",
    "robots", "drones", "3D printing", "sensors", "electricity", "magnets", "light", "sound",
    "music theory", "guitars", "pianos", "drums", "choirs", "opera", "dance", "festivals",
    "holidays", "birthdays", "weddings", "family", "parenting", "childhood", "old age",
    "kindness", "honesty", "courage", "patience", "habits", "motivation", "stress",
    "happiness",
]
TASKS = [
    "Explain {t} to a ten-year-old.",
    "Write three interesting facts about {t}.",
    "What are the pros and cons of {t}?",
    "Write a short poem about {t}.",
    "Give me a brief history of {t}.",
    "Summarize what everyone should know about {t} in one paragraph.",
    "Write a Python function related to {t}, with a docstring and comments.",
    "Answer briefly: why does {t} matter?",
    "Write a short story that involves {t}.",
    "List five questions a student might ask about {t}, with short answers.",
]

# A second prompt set ("varied"): everyday questions, summaries of a given passage (the
# target's own greedy answers to the templates above, used as passages) and code requests,
# so that the draft does not learn only the templates' answer style.
QUESTIONS = [
    "How does {t} work?", "Why do people care about {t}?", "What is the best way to learn "
    "about {t}?", "Can you give me some tips about {t}?", "What are common mistakes people "
    "make with {t}?", "How would you describe {t} to a friend?", "What is surprising about "
    "{t}?", "Is {t} good or bad for the environment?", "How has {t} changed in the last "
    "hundred years?", "What questions should I ask an expert on {t}?", "How do I get started "
    "with {t}?", "What does a typical day look like for someone who works with {t}?",
    "Could you tell me something fun about {t}?", "What should a beginner know about {t}?",
    "How do scientists study {t}?", "What would the world be like without {t}?",
]
CODE_TASKS = [
    "checks whether a number is prime", "reverses the words in a sentence",
    "returns the second largest number in a list", "removes vowels from a string",
    "converts a temperature from Celsius to Fahrenheit", "counts the lines in a text file",
    "checks whether two strings are anagrams", "flattens a nested list",
    "returns the factorial of a number", "finds the most common element in a list",
    "validates an email address with a regular expression", "sorts a list of dictionaries "
    "by one key", "splits a list into chunks of a given size", "computes the median of a list",
    "capitalises the first letter of every word", "returns the greatest common divisor of "
    "two numbers", "checks whether a year is a leap year", "sums the digits of a number",
    "groups words by their first letter", "returns the unique values of a list in order",
    "computes the average word length of a sentence", "converts a binary string to an "
    "integer", "finds all pairs in a list that add up to a target", "rotates a list by k "
    "places", "checks whether brackets in a string are balanced",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "Go", "Rust", "Java", "C"]


def varied_prompts(n: int, seed: int, passages: list[str]) -> list[str]:
    """`n` prompts, a third each of questions, passage summaries and code requests."""
    rng = random.Random(seed + 1)
    pools = [[q.format(t=t) for q in QUESTIONS for t in TOPICS],
             [f"Summarize the following passage in {k}.\n\n{p}" for p in passages
              for k in ("one sentence", "two sentences")],
             [f"Write a {lang} function that {task}." for lang in LANGUAGES
              for task in CODE_TASKS]]
    for pool in pools:
        rng.shuffle(pool)
    picked = [pool[i] for i in range(n) for pool in pools if i < len(pool)][:n]
    if len(picked) < n:
        raise ValueError(f"--varied-prompts can be at most {len(picked)}, got {n}")
    return picked


def passages_from(data: list[dict], tokenizer) -> list[str]:
    """The target's greedy template answers, cut at their last full stop, as passages."""
    out = []
    for ex in data:
        text = tokenizer.decode(ex["ids"][ex["start"] + 1:].tolist(), skip_special_tokens=True)
        text = text[:text.rfind(".") + 1].strip()
        if len(text) >= 200 and "```" not in text:
            out.append(text)
    return out


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
    kind: str = "model"  # "model": layers on tokens; "feature": export/feature_draft.py
    varied_prompts: int = 0
    more_prompts: int = 0  # the varied set's next prompts, answered after the first ones
    self_prompts: int = 0  # requests the target writes (export/self_prompts.py), answered last
    # A feature draft's earlier target layers (export/feature_draft.py); not data settings:
    # their outputs are computed from the answers afterwards (add_layer_features).
    feature_layers: list[int] = field(default_factory=list)
    mlp_width: int | None = None  # neurons of each draft layer's MLP; None: the target's

    DATA_FIELDS = ("target", "prompts", "new_tokens", "sampled_fraction", "generate_batch",
                   "seed", "top_k", "varied_prompts", "more_prompts", "self_prompts")

    def data_settings(self) -> dict:
        """What the generated data depends on; the rest only shapes training."""
        return {k: v for k, v in asdict(self).items() if k in self.DATA_FIELDS}


def training_prompts(n: int, seed: int) -> list[str]:
    """`n` distinct prompts from topic x task templates, shuffled with `seed`."""
    pool = [task.format(t=topic) for topic in TOPICS for task in TASKS]
    random.Random(seed).shuffle(pool)
    if n > len(pool):
        raise ValueError(f"--prompts can be at most {len(pool)}, got {n}")
    return pool[:n]


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
    # for a feature draft (export/feature_draft.py); captured as generation runs them.
    features = []
    hook = model.model.norm.register_forward_hook(
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
    # Step by step, each step's logits freed once read: stacking them first held three
    # [B, new, V] copies (SmolLM2 peaked at 12.2 GB with a batch of 128, now 5.9 GB).
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
            torch.save(shard, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
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
            torch.save(cached, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
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


def make_draft(target, layers: int, mlp_width: int | None = None):
    """A `layers`-layer model of the target's width, initialised from target layers; its
    MLPs `mlp_width` neurons wide (None: as wide as the target's)."""
    from transformers import AutoModelForCausalLM

    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = layers
    check_mlp_width(config, mlp_width)
    config.intermediate_size = mlp_width or config.intermediate_size
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    config.tie_word_embeddings = True
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for mine, theirs in zip(draft.model.layers, target.model.layers):
        copy_layer(mine, theirs)
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    # The target's embedding table, shared and frozen; the tied head reads the same rows.
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight
    draft.lm_head.weight = draft.model.embed_tokens.weight
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def new_draft(target, cfg: DistillConfig, head_ids: torch.Tensor):
    """The untrained draft that `cfg` describes, scoring `head_ids`."""
    if cfg.kind == "feature":
        return FeatureDraft(target, head_ids, cfg.feature_layers, cfg.mlp_width)
    draft = make_draft(target, cfg.layers, cfg.mlp_width)
    attach_head(draft, head_ids)
    return draft


def attach_head(draft, head_ids: torch.Tensor) -> None:
    """Mark the draft's output head as covering only `head_ids` (see export/graph.py)."""
    draft.register_buffer("specedge_head_ids", head_ids.long(), persistent=False)


def head_columns(head_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token id -> column of the draft's head, -1 for tokens outside it."""
    to_head = torch.full((vocab_size,), -1, dtype=torch.long)
    to_head[head_ids] = torch.arange(len(head_ids))
    return to_head


def top_k_cross_entropy(head_logits: torch.Tensor, ex: dict, to_head: torch.Tensor
                        ) -> tuple[torch.Tensor, int]:
    """Sum over one answer's positions of the cross-entropy of the draft's head distribution
    against the target's renormalised top-k, and how often the two argmaxes agree."""
    logq = torch.log_softmax(head_logits, dim=-1)
    cols = to_head[ex["top_ids"].long()]
    p = torch.where(cols >= 0, ex["top_logp"].float().exp(), torch.zeros(()))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    return -(p * logq.gather(1, cols.clamp_min(0))).sum(), int((logq.argmax(-1) ==
                                                                 cols[:, 0]).sum())


def _loss(draft, head_ids: torch.Tensor, batch: list[dict]) -> tuple[torch.Tensor, float]:
    """Cross-entropy of the draft's head distribution against the target's top-k."""
    width = max(len(ex["ids"]) for ex in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for b, ex in enumerate(batch):
        ids[b, :len(ex["ids"])] = ex["ids"].long()
        mask[b, :len(ex["ids"])] = 1
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
    to_head = head_columns(head_ids, draft.config.vocab_size)
    head_w = draft.model.embed_tokens.weight[head_ids]
    total, agree, count = 0.0, 0, 0
    for b, ex in enumerate(batch):
        n = len(ex["top_ids"])
        ce, hits = top_k_cross_entropy(hidden[b, ex["start"]:ex["start"] + n] @ head_w.T, ex,
                                       to_head)
        total, agree, count = total + ce, agree + hits, count + n
    return total / count, agree / count


def draft_loss(draft, head_ids: torch.Tensor, batch: list[dict]
               ) -> tuple[torch.Tensor, float]:
    """Training loss and top-1 agreement of either kind of draft on a batch."""
    if isinstance(draft, FeatureDraft):
        return feature_loss(draft, batch)
    return _loss(draft, head_ids, batch)


def train(draft, head_ids: torch.Tensor, data: list[dict], cfg: DistillConfig,
          work: Path) -> dict:
    """AdamW with cosine decay; checkpoints every 50 steps and resumes from the last."""
    rng = random.Random(cfg.seed)
    val = [data[i] for i in range(0, len(data), 20)]
    train_set = [ex for i, ex in enumerate(data) if i % 20]
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
        loss, agree = draft_loss(draft, head_ids, [train_set[i] for i in orders[step]])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{agree:.2f}")
        if step % 50 == 0 or step == total_steps:
            trainable = {k: v for k, v in draft.state_dict().items() if "embed_tokens" not in k
                         and "lm_head" not in k}
            torch.save({"draft": trainable, "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": step}, state_path.with_suffix(".tmp"))
            state_path.with_suffix(".tmp").rename(state_path)
    bar.close()
    draft.eval()
    with torch.no_grad():
        losses = [draft_loss(draft, head_ids, val[i:i + cfg.batch]) for i in
                  range(0, len(val), cfg.batch)]
    return {"val_loss": sum(x[0].item() for x in losses) / len(losses),
            "val_top1_agreement": sum(x[1] for x in losses) / len(losses),
            "train_sequences": len(train_set), "val_sequences": len(val), "steps": total_steps}


def save_draft(draft, head_ids: torch.Tensor, out: Path, meta: dict) -> dict:
    weights = {k: v.to(torch.float16).contiguous() for k, v in draft.state_dict().items()
               if "embed_tokens" not in k and "lm_head" not in k}
    save_file(weights, str(out / DRAFT_WEIGHTS))
    (out / DRAFT_WEIGHTS).chmod(0o644)
    meta = {**meta, "kind": "feature" if isinstance(draft, FeatureDraft) else "model",
            "num_layers": draft.config.num_hidden_layers,
            "mlp_width": draft.config.intermediate_size, "head_token_ids": head_ids.tolist()}
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
    state = {k: v.float() for k, v in load_file(str(path / DRAFT_WEIGHTS)).items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected or any("embed_tokens" not in k and "lm_head" not in k for k in missing):
        raise ValueError(f"{path / DRAFT_WEIGHTS} does not match its {DRAFT_META}; "
                         "re-run specedge distill")
    return draft.eval()


def distill(out: str | Path, cfg: DistillConfig) -> dict:
    """Run (or resume) the whole distillation; returns the draft's metadata."""
    from .sources import load_model

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
    out = Path(out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    # Generated data is reused only for the same data settings; a training state only for
    # the same settings altogether (otherwise training starts over on the cached data).
    # Data made without --self-prompts (or without both --more-prompts and --self-prompts)
    # may gain them: their shards come last. A setting added since the data or the training
    # state was made reads as its default, which is what that version did.
    data_path, run_path = work / "data-settings.json", work / "settings.json"
    if data_path.is_file():
        made = {**DistillConfig().data_settings(), **json.loads(data_path.read_text())}
        now = cfg.data_settings()
        if made not in (now, {**now, "self_prompts": 0},
                        {**now, "more_prompts": 0, "self_prompts": 0}):
            raise ValueError(f"{work} holds data generated with other settings; use another "
                             "--out or delete it")
    data_path.write_text(json.dumps(cfg.data_settings(), indent=1))
    if run_path.is_file() and {**asdict(DistillConfig()),
                               **json.loads(run_path.read_text())} != asdict(cfg):
        (work / "train.pt").unlink(missing_ok=True)
    run_path.write_text(json.dumps(asdict(cfg), indent=1))
    torch.manual_seed(cfg.seed)
    target, tokenizer = load_model(cfg.target)
    if target.config.model_type not in ("llama", "mistral", "qwen2"):
        raise ValueError("distill supports Llama, Mistral and Qwen2 targets")
    # Before the answers, which can take hours, rather than when the draft is built.
    check_feature_layers(cfg.feature_layers, target.config.num_hidden_layers)
    check_mlp_width(target.config, cfg.mlp_width)
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
