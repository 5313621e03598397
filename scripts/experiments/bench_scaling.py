"""What to expect with a real pair: plain speed, verification cost and draft cost of int4
models of real shapes on this CPU, and the speedup they predict.

Real checkpoints cost downloads and hours of export; the speed of a graph depends on its
shape, not on its weights. So each model here is its published config.json (literal dicts
below) with random weights, exported to an int4 bundle, and measured:

1. plain decoding: tokens per second of one-token steps (argmax included) after a 64-token
   prompt, through the target graph's ort-cpu backend;
2. r(T): the cost of one T-token verification call over a one-token step, T = 1..9 (a step
   with K drafts calls the target on K + 1 tokens, so K = 1..8 needs T up to 9);
3. c: the cost of a draft step (argmax included, timed over bursts of 4 steps as the loop
   drafts them) over a one-token target step, for two drafts: (a) the SmolLM2-135M shape,
   (b) the target's own first layer and head (`draft_layers=1`);
4. the speedup these costs predict at acceptance alpha = 0.6, 0.7, 0.8 for the best K in
   1..8 (docs/design.md#expected-tokens-per-call-and-ideal-speedup, with the measured r in
   place of a flat verification cost):

       speedup(K) = ((1 - alpha^(K+1)) / (1 - alpha)) / (K c + r(K+1))

5. where llama-cpp-python is installed, llama.cpp's plain decoding of the same random
   weights written as a Q4_1 GGUF (gguf_writer.py beside this script), with the same threads and the
   same 64-token prompt. Q4_1, not Q4_0: our int4 stores each block of 32 weights as
   w = d * q + m, which is Q4_1's grid (export/quantize.py), so Q4_1 is the same
   weight format; Q4_0 has no offset (4.5 bits a weight against 5) and would compare a
   coarser model.

Every timed block (the plain run, each T, each draft burst, llama.cpp's run) takes turns with
the others, the first of them changing every run, and is reported by its median, so the
machine's drift falls on all of them alike (docs/bench.md#reading-the-ratios). Shapes are
measured one after another, each with its drafts.

The prediction leaves out the host's work per step (verification, the draft's draws; 2-8%
of decode time in docs/MEASUREMENTS.md) and assumes each draft is accepted independently
with probability alpha. For the Qwen2.5 and Llama 3.2 shapes the 135M draft keeps SmolLM2's
49152-token vocabulary; a real draft with their 152k / 128k vocabularies has a larger head,
so its c is higher than measured here.

Where real pairs reach such acceptance: what could be found published. Each source counts
in its own way; llama.cpp reports accepted / drafted tokens, drafts after the first rejection
included, which reads lower than the per-token alpha here (docs/design.md counts examined
drafts only).

- Qwen2.5-7B (int4) with Qwen2.5-0.5B as draft, greedy, 3 drafts a step, in the pure-Go
  tensai: 51% acceptance, 1.33x (github.com/mattn/tensai/pull/44).
- Qwen2.5-Coder-14B-Instruct (Q4_K_M, llama.cpp, RTX 5060 Ti) with Qwen2.5 drafts: 0.5B 26%,
  1.5B 40%, 3B 87% acceptance (inventivehq.com/blog/speculative-decoding-draft-model-size-sweep).
- Meta-Llama-3-70B-Instruct with Meta-Llama-3-8B-Instruct as draft (both Q4_K_M, llama.cpp,
  8 drafts): 58.68% accepted (devquasar.com/uncategorized/
  speculative-decoding-tradeoffs-gpu-with-large-models-llama-70b-8b/).
- This project's one-layer feature draft for SmolLM2-135M-Instruct: 0.36-0.40 greedy
  (docs/MEASUREMENTS.md, "Draft acceptance and cost").
- No published acceptance rate was found for SmolLM2-135M drafting SmolLM2-360M or -1.7B,
  nor for Llama-3.2-1B drafting Llama-3.1-8B.

So the off-the-shelf pairs above measure 0.26-0.59; 0.7 and more took a draft a fifth of its
target's size (the 3B for the 14B, at 87%).

    python scripts/experiments/bench_scaling.py [--shapes SmolLM2-135M SmolLM2-360M Qwen2.5-0.5B
        Llama-3.2-1B] [--threads N] [--runs 20] [--out bench_results/scaling.json]

Checkpoints, bundles and GGUF files are kept beside the output, in
bench_results/scaling/{models,bundles,gguf}/NAME, and reused by later runs. Writes the JSON
and prints a table per shape and a markdown table for the README.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from specedge.export.bundle_writer import ExportError, export_bundle
from specedge.runtime.atomic_files import atomic_write, replacing
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import load_bundle
from specedge.runtime.stats import expected_tokens_per_call

ROOT = Path(__file__).resolve().parents[2]
SEED = 0
CONTEXT = 64         # prompt tokens before every timed call
PLAIN_TOKENS = 16    # one-token steps per timed plain-decoding block
# A draft's steps are timed in bursts, as the loop runs them: K in a row, right after the
# target's call, so that the switch between graphs costs the burst what it costs the loop.
DRAFT_BURST = 4
MAX_K = 8
TOKENS = range(1, MAX_K + 2)  # T of the verification calls: K + 1 for K = 0..MAX_K
ALPHAS = (0.6, 0.7, 0.8)
# The bundles' context: what the bench's generations need, and small rotary tables.
MAX_CONTEXT = 2048
LLAMA_CPP_QUANT = "q4_1"  # our int4's grid (module docstring)
ONE_LAYER = "1-layer"

# Each shape's published config.json, the fields that set its size and speed (bos and eos are
# the placeholder tokenizer's). "draft" names the shape that drafts for it in the c (a) column.
SHAPES: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M
    "SmolLM2-135M": {"config": {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
        "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "bos_token_id": 1,
        "eos_token_id": 2}, "draft": "SmolLM2-135M"},
    # HuggingFaceTB/SmolLM2-360M
    "SmolLM2-360M": {"config": {
        "model_type": "llama", "hidden_size": 960, "num_hidden_layers": 32,
        "num_attention_heads": 15, "num_key_value_heads": 5, "intermediate_size": 2560,
        "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "bos_token_id": 1,
        "eos_token_id": 2}, "draft": "SmolLM2-135M"},
    # Qwen/Qwen2.5-0.5B
    "Qwen2.5-0.5B": {"config": {
        "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
        "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "bos_token_id": 1,
        "eos_token_id": 2}, "draft": "SmolLM2-135M"},
    # meta-llama/Llama-3.2-1B
    "Llama-3.2-1B": {"config": {
        "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
        "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "head_dim": 64,
        "bos_token_id": 1, "eos_token_id": 2}, "draft": "SmolLM2-135M"},
}
PUBLISHED = list(SHAPES)
# Not a published model: seconds to build and measure, for the tests. Head size 16, the
# smallest that the fused int4 graphs take, like the real shapes' 64.
_TINY = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1024,
         "tie_word_embeddings": True, "rope_theta": 10000.0, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
SHAPES["tiny"] = {"config": {**_TINY, "num_hidden_layers": 4}, "draft": "tiny-draft"}
SHAPES["tiny-draft"] = {"config": {**_TINY, "num_hidden_layers": 2}, "draft": "tiny-draft"}


# ----------------------------------------------------------------------------- the math

def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step with `k` drafts emits on average, each draft accepted independently
    with probability `alpha`: 1 + alpha + ... + alpha^k."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return expected_tokens_per_call(alpha, k)


def predicted_speedup(alpha: float, k: int, c: float, r_k1: float) -> float:
    """Speedup over plain decoding of steps with `k` drafts: expected tokens per step over
    the step's cost in one-token target steps, `k` draft steps of cost `c` plus one
    (k + 1)-token call of cost `r_k1` = r(k + 1). docs/design.md#expected-tokens-per-call-
    and-ideal-speedup is the case r_k1 = 1."""
    return expected_tokens(alpha, k) / (k * c + r_k1)


def best_k(alpha: float, c: float, r: dict[int, float], max_k: int = MAX_K) -> tuple[int, float]:
    """(K, speedup) of the K in 1..max_k with the highest predicted speedup; `r` maps T to
    the relative cost of a T-token call and needs T = 2..max_k + 1."""
    missing = [t for t in range(2, max_k + 2) if t not in r]
    if missing:
        raise ValueError(f"r lacks the cost of T = {missing}; measure T up to {max_k + 1}")
    return max(((k, predicted_speedup(alpha, k, c, r[k + 1])) for k in range(1, max_k + 1)),
               key=lambda ks: ks[1])


# ------------------------------------------------------------------ models and bundles

def _tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2's scheme, as SmolLM2, Qwen2.5 and Llama 3 use, and
    the kind gguf_writer.py writes) with exactly `vocab_size` tokens: <unk>, <s>,
    </s>, the 256 byte symbols, then merged pairs and triples of them. The export needs a
    tokenizer.json that covers the vocabulary; its merges mean nothing."""
    from itertools import chain, product

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    merges = []
    pairs = ((a, b) for a, b in product(alphabet, repeat=2))
    triples = ((a + b, c) for a, b, c in product(alphabet, repeat=3))
    for left, right in chain(pairs, triples):
        if len(vocab) >= vocab_size:
            break
        merges.append((left, right))
        vocab[left + right] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"a vocabulary of {vocab_size} tokens needs at least {len(vocab)}")
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def build_checkpoint(name: str, cache: Path) -> Path:
    """The shape's random-weight checkpoint (seed SEED), built once into cache/models/NAME."""
    out = cache / "models" / name
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(SHAPES[name]["config"])
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).eval()
    with replacing(out, folder=True) as tmp:
        model.save_pretrained(tmp)
        _tokenizer(config.vocab_size).save_pretrained(tmp)
    return out


def export(name: str, checkpoint: Path, cache: Path) -> Path:
    """The int4 bundle of `checkpoint` with its one-layer draft (export_bundle skips it when
    it is up to date)."""
    out = cache / "bundles" / name
    export_bundle(str(checkpoint.resolve()), out, draft_layers=1, max_context=MAX_CONTEXT,
                  precision="int4")
    return out


def parameters(checkpoint: Path) -> int:
    """Parameters stored in the checkpoint (tied embeddings once), from the safetensors
    headers."""
    from safetensors import safe_open

    total = 0
    for f in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as st:
            total += sum(int(np.prod(st.get_slice(k).get_shape())) for k in st.keys())
    return total


def graph_bytes(spec_path: Path) -> int:
    """A graph file's size with its external data files (NAME.*) beside it."""
    return spec_path.stat().st_size + sum(
        p.stat().st_size for p in spec_path.parent.glob(f"{spec_path.name}.*") if p.is_file())


# ---------------------------------------------------------------------------- timing

def prompt_ids(vocab_size: int) -> list[int]:
    """CONTEXT token ids spread over the vocabulary (random weights: any ids will do)."""
    return [(7 + 31 * i) % vocab_size for i in range(CONTEXT)]


class Model:
    """One graph on ort-cpu with its cache holding the prompt, and its timed blocks."""

    def __init__(self, spec, threads: int):
        self.backend = OrtCpuBackend(spec, threads)
        self.cache = self.backend.new_cache(CONTEXT + max(PLAIN_TOKENS, DRAFT_BURST,
                                                          max(TOKENS)))
        self.prompt = prompt_ids(spec.vocab_size)
        self.backend.forward(self.cache, self.prompt, 1)

    def call(self, t: int) -> Callable[[], float]:
        """One T-token call after the prompt, keeping every row's logits (a verification)."""
        ids = self.prompt[1:1 + t]

        def run() -> float:
            self.cache.rollback(CONTEXT)
            t0 = time.perf_counter()
            self.backend.forward(self.cache, ids, t)
            return time.perf_counter() - t0
        return run

    def steps(self, n: int) -> Callable[[], float]:
        """`n` one-token steps after the prompt, each token the argmax of the last: plain
        decoding, or a draft's burst of K steps between two verifications."""
        def run() -> float:
            self.cache.rollback(CONTEXT)
            token = self.prompt[-1]
            t0 = time.perf_counter()
            for _ in range(n):
                token = int(np.argmax(self.backend.forward(self.cache, [token], 1)[0]))
            return time.perf_counter() - t0
        return run


def take_turns(blocks: dict[str, Callable[[], float]], runs: int,
               warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of each timed block, `runs` times each; the blocks take turns, the first of
    them changing every run. Each runs `warmup` times untimed first."""
    names = list(blocks)
    for name in names:
        for _ in range(warmup):
            blocks[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(runs):
        turn = i % len(names)
        for name in names[turn:] + names[:turn]:
            times[name].append(blocks[name]())
    return times


# --------------------------------------------------------------------------- llama.cpp

def llama_cpp_block(name: str, checkpoint: Path, cache: Path, threads: int,
                    vocab_size: int) -> tuple[Callable[[], float] | None, dict]:
    """llama.cpp's timed plain-decoding block for this shape and what to report with it,
    or (None, {"skipped": why})."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None, {"skipped": "llama-cpp-python not installed "
                                 "(bash scripts/install_llama_cpp.sh)"}
    try:
        from gguf_writer import write_gguf
    except ImportError as e:
        return None, {"skipped": f"no GGUF writer (scripts/experiments/gguf_writer.py: {e})"}
    import llama_cpp

    from specedge.bench.baselines import _llama_cpp_batch

    def argmax() -> int:
        # The last call's logits, read as plain decoding's sampler reads them (Llama.scores
        # holds them only with logits_all, which computes every position's).
        logits = llama_cpp.llama_get_logits(llm.ctx)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab_size,))))

    gguf = cache / "gguf" / f"{name}-{LLAMA_CPP_QUANT}.gguf"
    try:
        if not gguf.is_file() or gguf.stat().st_mtime < (checkpoint / "config.json").stat(
                ).st_mtime:
            gguf.parent.mkdir(parents=True, exist_ok=True)
            write_gguf(checkpoint, gguf, quant=LLAMA_CPP_QUANT)
        n_batch = _llama_cpp_batch(gguf, threads)
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=256, n_threads=threads,
                              n_batch=n_batch, verbose=False)
        llm.eval(prompt_ids(vocab_size))
        first = argmax()
    except Exception as e:  # an optional column: the ONNX figures still stand
        return None, {"skipped": f"llama.cpp failed on {gguf.name}: {type(e).__name__}: {e}"}

    def run() -> float:
        # Back to the prompt: the next eval drops the cache rows from n_tokens on, as
        # llama-cpp-python's own generate does when a prompt shares a prefix.
        llm.n_tokens = CONTEXT
        token = first
        t0 = time.perf_counter()
        for _ in range(PLAIN_TOKENS):
            llm.eval([token])
            token = argmax()
        return time.perf_counter() - t0

    return run, {"quant": LLAMA_CPP_QUANT, "n_batch": n_batch, "gguf": str(gguf),
                 "gguf_mb": gguf.stat().st_size / 1e6}


# ------------------------------------------------------------------------- one shape

def measure_shape(name: str, bundle: Path, draft_bundle: Path | None, checkpoint: Path,
                  cache: Path, threads: int, runs: int) -> dict:
    """Every figure of one shape (see the module docstring)."""
    loaded = load_bundle(bundle)
    target = Model(loaded.target, threads)
    blocks: dict[str, Callable[[], float]] = {"plain": target.steps(PLAIN_TOKENS)}
    blocks.update({f"T={t}": target.call(t) for t in TOKENS})
    drafts = {ONE_LAYER: Model(loaded.draft, threads)}
    if draft_bundle is not None:
        drafts[SHAPES[name]["draft"]] = Model(load_bundle(draft_bundle).target, threads)
    blocks.update({f"draft {d}": m.steps(DRAFT_BURST) for d, m in drafts.items()})
    llama_run, llama = llama_cpp_block(name, checkpoint, cache, threads,
                                       loaded.target.vocab_size)
    if llama_run is not None:
        blocks["llama.cpp"] = llama_run
    times = take_turns(blocks, runs)
    med = {k: statistics.median(v) for k, v in times.items()}
    r = {t: med[f"T={t}"] / med["T=1"] for t in TOKENS}
    c = {d: med[f"draft {d}"] / DRAFT_BURST / med["T=1"] for d in drafts}
    if llama_run is not None:
        llama["tokens_per_second"] = PLAIN_TOKENS / med["llama.cpp"]
    return {
        "config": SHAPES[name]["config"],
        "params": parameters(checkpoint),
        "int4_mb": graph_bytes(loaded.target.path) / 1e6,
        "bundle": str(bundle),
        "plain_tokens_per_second": PLAIN_TOKENS / med["plain"],
        "step_ms": {str(t): 1000 * med[f"T={t}"] for t in TOKENS},
        "r": {str(t): r[t] for t in TOKENS},
        "draft_step_ms": {d: 1000 * med[f"draft {d}"] / DRAFT_BURST for d in drafts},
        "c": c,
        "predicted": {d: {str(a): dict(zip(("k", "speedup"), best_k(a, c[d], r)))
                          for a in ALPHAS} for d in drafts},
        "llama_cpp": llama,
    }


# ---------------------------------------------------------------------------- report

def machine() -> dict:
    """CPU model, cores and vector / matrix instruction sets (avx*, amx*)."""
    cpu, flags = None, []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and cpu is None:
                cpu = value
            elif key == "flags" and not flags:
                flags = sorted(f for f in value.split() if f.startswith(("avx", "amx")))
    except OSError:  # not Linux
        pass
    return {"cpu": cpu or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "flags": flags, "system": platform.platform()}


def git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _params(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _speedups(row: dict, alpha: float, drafts: list[str]) -> str:
    cells = []
    for d in drafts:
        p = row["predicted"].get(d)
        cells.append("—" if p is None else f"{p[str(alpha)]['speedup']:.2f}x")
    return " / ".join(cells)


def print_tables(results: dict) -> None:
    shapes = {n: row for n, row in results["shapes"].items() if "failed" not in row}
    ts = [str(t) for t in TOKENS if t > 1]
    print(f"\n| shape | plain tok/s | step ms | {' | '.join(f'r({t})' for t in ts)} "
          "| draft | c | best K, speedup at alpha " + " / ".join(map(str, ALPHAS)) + " |")
    print(f"|---|---|---|{'---|' * len(ts)}---|---|---|")
    for name, row in shapes.items():
        for i, (d, c) in enumerate(row["c"].items()):
            first = [name, f"{row['plain_tokens_per_second']:.1f}", f"{row['step_ms']['1']:.1f}",
                     *(f"{row['r'][t]:.2f}" for t in ts)]
            best = ", ".join(f"K={row['predicted'][d][str(a)]['k']} "
                             f"{row['predicted'][d][str(a)]['speedup']:.2f}x" for a in ALPHAS)
            cells = (first if i == 0 else [""] * len(first)) + [d, f"{c:.3f}", best]
            print(f"| {' | '.join(cells)} |")
    small = next((SHAPES[n]["draft"] for n in shapes), SHAPES[PUBLISHED[-1]]["draft"])
    print(f"\nREADME table (int4, {results['threads']} threads, {results['machine']['cpu']}; "
          f"speedup cells: {small} draft / 1-layer draft, best K in 1..{MAX_K}; "
          f"llama.cpp {LLAMA_CPP_QUANT.upper()}):\n")
    print(f"| shape | params | int4 MB | plain tok/s | r(5) | c ({small} draft) | "
          "c (1-layer draft) | " + " | ".join(f"speedup α={a}" for a in ALPHAS)
          + f" | llama.cpp {LLAMA_CPP_QUANT.upper()} tok/s |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(ALPHAS) + "---|")
    for name, row in shapes.items():
        c_small = row["c"].get(small)
        llama = row["llama_cpp"].get("tokens_per_second")
        print(f"| {name} | {_params(row['params'])} | {row['int4_mb']:.0f} | "
              f"{row['plain_tokens_per_second']:.1f} | {row['r']['5']:.2f} | "
              f"{'—' if c_small is None else f'{c_small:.3f}'} | {row['c'][ONE_LAYER]:.3f} | "
              + " | ".join(_speedups(row, a, [small, ONE_LAYER]) for a in ALPHAS)
              + f" | {'—' if llama is None else f'{llama:.1f}'} |")
    notes = {row["llama_cpp"]["skipped"] for row in shapes.values()
             if "skipped" in row["llama_cpp"]}
    for note in sorted(notes):
        print(f"\nllama.cpp column skipped: {note}")
    for name, row in results["shapes"].items():
        if "failed" in row:
            print(f"\n{name}: not measured: {row['failed']}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=PUBLISHED, metavar="NAME",
                    help=f"shapes to measure, of: {', '.join(PUBLISHED)} (default: all)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="ONNX Runtime and llama.cpp threads (default: all cores)")
    ap.add_argument("--runs", type=int, default=20, help="timed runs of every block")
    ap.add_argument("--out", type=Path, default=Path("bench_results/scaling.json"),
                    help="the JSON report; models, bundles and GGUF files go in a folder of "
                         "its name beside it")
    args = ap.parse_args(argv)
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(PUBLISHED)}")
    if args.runs < 1 or args.threads < 1:
        ap.error("--runs and --threads must be at least 1")
    cache = args.out.parent / args.out.stem

    results = {
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["python", "scripts/experiments/bench_scaling.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "threads": args.threads, "runs": args.runs, "precision": "int4",
        "context": CONTEXT, "plain_tokens": PLAIN_TOKENS, "max_k": MAX_K,
        "alphas": list(ALPHAS), "max_context": MAX_CONTEXT,
        "shapes": {},
    }
    bundles: dict[str, tuple[Path, Path]] = {}

    def ready(name: str) -> tuple[Path, Path]:
        """(checkpoint, bundle) of a shape, built and exported once."""
        if name not in bundles:
            t0 = time.perf_counter()
            checkpoint = build_checkpoint(name, cache)
            bundles[name] = (checkpoint, export(name, checkpoint, cache))
            print(f"{name}: model and bundle ready in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr)
        return bundles[name]

    for name in dict.fromkeys(args.shapes):
        t0 = time.perf_counter()
        draft = SHAPES[name]["draft"]
        try:
            checkpoint, bundle = ready(name)
            draft_bundle = None if draft == name else ready(draft)[1]
        except ExportError as e:  # the other shapes are still worth their hour
            results["shapes"][name] = {"failed": str(e)}
            print(f"{name}: not measured: {e}", file=sys.stderr)
            continue
        t1 = time.perf_counter()
        row = measure_shape(name, bundle, draft_bundle, checkpoint, cache, args.threads,
                            args.runs)
        row["seconds"] = {"build_and_export": t1 - t0, "measure": time.perf_counter() - t1}
        results["shapes"][name] = row
        print(f"{name}: measured in {row['seconds']['measure']:.0f} s", file=sys.stderr)
        atomic_write(args.out, json.dumps(results, indent=2) + "\n")  # what is done so far
    atomic_write(args.out, json.dumps(results, indent=2) + "\n")
    print_tables(results)
    print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    main()
