"""Host-side cost of one speculative step's token selector at large vocabularies, against the
LM head call alone.

With K draft tokens a step chooses tokens from K draft rows and K + 1 target rows on the
host (runtime/token_selection.py HostSelector: `draw` per draft row, then `verify`).
That work grows with V like the head call does; this measures whether it stays small next
to it.

    python scripts/experiments/bench_vocab.py [--vocabs 32768 131072 262144] [--k 4]
        [--hidden 2048] [--runs 20] [--profile]
    python scripts/experiments/bench_vocab.py --bundles B1 [B2 ...] [--runs 20]

Rows are synthetic float32 logits shaped like an LM's: a normal bulk (std 2.5) with 20
tokens raised by 6 + Exp(4), so the top few hold most of the mass. The draft rows equal the
target rows, so every draft is accepted and the step processes all K + 1 target rows: the
most host work a step can do. Host modes: greedy, and sampled at temperature 0.8 plain,
with top_p 0.95 and with top_k 50.

The reference is the LM head alone, as the bundles have it: a one-node ONNX Runtime session,
float32 MatMul [T, H] x [H, V], and int4 MatMulNBits (blocks of 32, asymmetric,
accuracy_level 4, as export/quantize.py makes it), for T = 1 and T = K + 1.

Within one run everything is interleaved: for each repetition and vocabulary, each head
call in turn, then each host mode twice, the first time right after an int4 head call
("after call": its code and data are cold, as in the loop; docs/MEASUREMENTS.md "What a
numpy call costs after a model call") and once more back to back ("warm"). Medians.
Prints a table and writes bench_results/vocab.json. `--profile` then prints cProfile's top
functions of the sampled modes at the largest V.

`--bundles` instead times each bundle's one-token target and draft calls (ort-cpu, after a
100-token prompt, interleaved, medians): what a draft whose head scores a subset of the
vocabulary (`specedge export --draft-head-tokens`) costs against its target. Writes
bench_results/vocab_bundles.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from specedge.runtime.config import Sampling
from specedge.runtime.token_selection import HostSelector

MODES = {"greedy": Sampling(0.0), "T0.8": Sampling(0.8), "T0.8 top_p 0.95": Sampling(0.8, 0, 0.95),
         "T0.8 top_k 50": Sampling(0.8, 50)}
BLOCK = 32


def lm_rows(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """n synthetic logit rows [n, V] float32 (module docstring)."""
    rows = rng.normal(0.0, 2.5, (n, vocab)).astype(np.float32)
    for row in rows:
        top = rng.choice(vocab, 20, replace=False)
        row[top] += (6 + rng.exponential(4.0, 20)).astype(np.float32)
    return rows


def head_session(path: Path, hidden: int, vocab: int, int4: bool,
                 rng: np.random.Generator) -> ort.InferenceSession:
    """A one-node session [T, H] -> [T, V]: the LM head, float32 or int4 MatMulNBits."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", hidden])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", vocab])
    if int4:
        blocks = hidden // BLOCK
        weights = {"w": rng.integers(0, 256, (vocab, blocks, BLOCK // 2), dtype=np.uint8),
                   "scales": rng.random(vocab * blocks, dtype=np.float32) * 0.01,
                   "zeros": rng.integers(0, 256, vocab * ((blocks + 1) // 2), dtype=np.uint8)}
        node = helper.make_node("MatMulNBits", ["x", "w", "scales", "zeros"], ["y"],
                                domain="com.microsoft", K=hidden, N=vocab, bits=4,
                                block_size=BLOCK, accuracy_level=4)
    else:
        weights = {"w": rng.standard_normal((hidden, vocab), dtype=np.float32) * 0.02}
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "head", [x], [y],
                              initializer=[_external(a, n, path) for n, a in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)  # what the ONNX Runtime releases in use read
    onnx.save(model, str(path))
    options = ort.SessionOptions()
    options.add_session_config_entry("session.force_spinning_stop", "1")  # as ort_cpu.py
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _external(array: np.ndarray, name: str, path: Path) -> TensorProto:
    """An initializer whose data is in a file beside `path`: an fp32 head of 262144 x 2048
    is 2 GiB, past protobuf's limit, so no tensor is serialized into the model."""
    location = f"{path.stem}.{name}.bin"
    array.tofile(path.parent / location)
    tensor = TensorProto(name=name, dims=array.shape,
                         data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("length", str(array.nbytes))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def host_step(selector: HostSelector, sampling: Sampling, draft: np.ndarray, target: np.ndarray,
              rng: np.random.Generator) -> int:
    """One step's host token selector, as the loop makes it: K draws, one verification."""
    q, drafts = [], []
    for row in draft:
        x, _ = selector.draw(row[None], sampling, rng, q, False)
        drafts.append(x)
    n, _ = selector.verify(target, drafts, selector.q(q), sampling, rng)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[32768, 131072, 262144])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--bundles", type=Path, nargs="+")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.bundles:
        bench_bundles(args.bundles, args.runs,
                      args.out or Path("bench_results/vocab_bundles.json"))
        return
    args.out = args.out or Path("bench_results/vocab.json")
    rng = np.random.default_rng(0)
    selector = HostSelector()
    heads = {(h, t): f"{h} T={t}" for h in ("fp32", "int4") for t in (1, args.k + 1)}
    times: dict[int, dict[str, list[float]]] = {}
    rows, sessions = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in args.vocabs:
            target = lm_rows(rng, args.k + 1, v)
            rows[v] = (target[:args.k].copy(), target)
            for h in ("fp32", "int4"):
                sessions[v, h] = head_session(Path(tmp) / f"{h}_{v}.onnx", args.hidden, v,
                                              h == "int4", rng)
            times[v] = {name: [] for name in heads.values()}
            times[v] |= {f"{m} {w}": [] for m in MODES for w in ("after call", "warm")}
        inputs = {t: rng.standard_normal((t, args.hidden), dtype=np.float32)
                  for t in (1, args.k + 1)}
        for v in args.vocabs:  # one untimed pass of everything
            for (h, t) in heads:
                sessions[v, h].run(None, {"x": inputs[t]})
            for sampling in MODES.values():
                host_step(selector, sampling, *rows[v], rng)
        for _ in range(args.runs):
            for v in args.vocabs:
                for (h, t), name in heads.items():
                    t0 = time.perf_counter()
                    sessions[v, h].run(None, {"x": inputs[t]})
                    times[v][name].append(time.perf_counter() - t0)
                for mode, sampling in MODES.items():
                    sessions[v, "int4"].run(None, {"x": inputs[1]})
                    for when in ("after call", "warm"):
                        t0 = time.perf_counter()
                        n = host_step(selector, sampling, *rows[v], rng)
                        times[v][f"{mode} {when}"].append(time.perf_counter() - t0)
                        assert n == args.k, "equal draft and target rows accept every draft"
        if args.profile:
            profile(selector, rows[max(args.vocabs)], rng)

    ms = {v: {name: 1000 * statistics.median(ts) for name, ts in by.items()}
          for v, by in times.items()}
    print(f"K = {args.k}, H = {args.hidden}, {args.runs} runs; medians in ms; host share = "
          f"host after call / int4 T=1 head")
    print("| V | " + " | ".join(heads.values()) + " | "
          + " | ".join(f"{m} (warm)" for m in MODES) + " |")
    print("|---|" + "---|" * (len(heads) + len(MODES)))
    for v in args.vocabs:
        head = " | ".join(f"{ms[v][name]:.2f}" for name in heads.values())
        int4 = ms[v]["int4 T=1"]
        host = " | ".join(f"{ms[v][m + ' after call']:.2f} ({ms[v][m + ' warm']:.2f}); "
                          f"{100 * ms[v][m + ' after call'] / int4:.1f}%" for m in MODES)
        print(f"| {v} | {head} | {host} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"k": args.k, "hidden": args.hidden, "runs": args.runs,
                                    "median_ms": ms}, indent=2) + "\n")
    print(f"wrote {args.out}")


def bench_bundles(bundles: list[Path], runs: int, out: Path) -> None:
    from specedge.runtime.backends.ort_cpu import OrtCpuBackend
    from specedge.runtime.bundle import load_bundle

    context, results = 100, []
    print("| bundle | draft head tokens | target call | draft call | draft / target |")
    print("|---|---|---|---|---|")
    for path in bundles:
        bundle = load_bundle(path)
        head = json.loads((path / "manifest.json").read_text())["models"]["draft"].get(
            "head_tokens", bundle.draft.vocab_size)
        models = {role: OrtCpuBackend(spec) for role, spec in
                  (("target", bundle.target), ("draft", bundle.draft))}
        caches = {role: be.new_cache(context + 1) for role, be in models.items()}
        times = {role: [] for role in models}
        for role, be in models.items():
            be.forward(caches[role], list(range(1, context + 1)), 1)
        for _ in range(runs):
            for role, be in models.items():
                caches[role].rollback(context)
                t0 = time.perf_counter()
                be.forward(caches[role], [7], 1)
                times[role].append(time.perf_counter() - t0)
        ms = {role: 1000 * statistics.median(t) for role, t in times.items()}
        results.append({"bundle": str(path), "vocab": bundle.target.vocab_size,
                        "draft_head_tokens": head, "median_ms": ms})
        print(f"| {path.name} | {head} of {bundle.target.vocab_size} | {ms['target']:.2f} ms "
              f"| {ms['draft']:.2f} ms | {ms['draft'] / ms['target']:.3f} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"context": context, "runs": runs, "rows": results},
                              indent=2) + "\n")
    print(f"wrote {out}")


def profile(selector: HostSelector, rows: tuple[np.ndarray, np.ndarray],
            rng: np.random.Generator) -> None:
    for mode, sampling in MODES.items():
        if sampling.greedy:
            continue
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            host_step(selector, sampling, *rows, rng)
        prof.disable()
        print(f"--- {mode}, V = {rows[1].shape[1]}, 20 steps")
        pstats.Stats(prof).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
