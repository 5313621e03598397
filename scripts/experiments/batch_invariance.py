"""Where a target graph stops being batch invariant: the first node whose output differs
between one T-token call and T one-token steps over the same cached prefix.

    python scripts/experiments/batch_invariance.py locate BUNDLE [--t 4] [--threads N]
        [--graph optimized|source] [--top 20]
    python scripts/experiments/batch_invariance.py locate --tiny int4 --attention fused
    python scripts/experiments/batch_invariance.py options BUNDLE [--rounds 5]

`locate` runs the graph the way the ort-cpu backend does (its session options, its IO
binding, the KV cache in place for a fused graph) with every intermediate value added as
a graph output, once as a T-token call and once as T one-token steps after the same
prefix, and compares each value row by row (the axis that is T long in the call and 1 in
a step). With `--graph optimized` (the default) the instrumented graph is ONNX Runtime's
own optimized graph, saved by a session with the runtime's options and reopened with
optimizations off, so the kernels are those the runtime runs (instrumenting the source
graph instead blocks the fusions whose inner values become outputs). It prints:

- the first differing values in topological order (op type, max |difference|);
- the sources: nodes whose output differs although each of their inputs is bit-identical
  row by row (where a difference is born, not where it is carried);
- the logits' and the new K/V rows' max |difference|.

With `--local`, each node is also run alone on the call's inputs, as one call and row by
row: which ops are row-invariant by themselves, whatever their inputs.

Found with ONNX Runtime 1.31 on an AVX2 CPU (no AVX-512/VNNI), SmolLM2-135M, T=4:
fused int8: the only source is GroupQueryAttention (~1e-7 at layer 0; consistent with its
probs x V product, alpha 1, taking MLAS's M=1 sgemm kernel in a one-token call, which sums
in another order than the multi-row kernel); fused int4: 4-bit
MatMulNBits (~1e-6, every accuracy level, with or without zero points) and
GroupQueryAttention; portable graphs: the attention (past and new keys in two products,
added). The int8-activation kernels then turn 1e-7 into ~1 logit within 30 layers. Every
kernel gives the same row for any call of two or more rows: one-token calls padded to
two rows are bit-identical to the rows of a K+1-token call (`one_step`); the runtime's
target backend now runs one-token steps that way (ort_cpu.py, `one_token_as_two`), and this
script's backends do not, so that it measures the kernels themselves.

`options` measures candidate fixes on a bundle's target: for each, the max logit
difference (T=4, several prompts) and the speed of plain one-token decoding relative to
the graph as exported, interleaved in one process, medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

import specedge.runtime.backends.ort_cpu as ort_cpu
from specedge.runtime.bundle import ModelSpec, load_bundle

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Photosynthesis is the process by which plants",
    "1, 2, 3, 5, 8, 13, 21,",
]
SKIP_OPS = {"Shape", "Constant"}


def session_options(threads: int | None, level=None, optimized_path: Path | None = None,
                    configs: dict | None = None):
    """The runtime's session options (ort_cpu.open_session), with overrides."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                                        if level is None else level)
    if threads:
        options.intra_op_num_threads = threads
    options.add_session_config_entry("session.force_spinning_stop", "1")
    for key, value in (configs or {}).items():
        options.add_session_config_entry(key, value)
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    return options


def open_backend(spec: ModelSpec, session, extras: list[str] = ()) -> ort_cpu.OrtCpuBackend:
    """An OrtCpuBackend over `session` that also fetches the values `extras` each call."""

    class Probe(ort_cpu.OrtCpuBackend):
        last = None

        def _bind(self, cache, t, n, f):
            b = super()._bind(cache, t, n, f)
            for name in extras:
                b.io.bind_output(name, "cpu")
            Probe.last = b
            return b

        def values(self) -> dict[str, np.ndarray]:
            got = Probe.last.io.copy_outputs_to_cpu()
            return dict(zip(extras, got[len(got) - len(extras):]))

        def forward(self, cache, token_ids, logits_to_keep=1, features=None):
            self._bindings = {}  # bound anew each call: Probe.last is this call's binding
            return super().forward(cache, token_ids, logits_to_keep, features)

    saved = ort_cpu.open_session
    ort_cpu.open_session = lambda *_: session
    try:
        # One-token calls as they come: the runtime's padding is one of the options.
        return Probe(spec, None, one_token_as_two=False)
    finally:
        ort_cpu.open_session = saved


def instrumented(spec: ModelSpec, mode: str, threads: int | None, folder: Path,
                 configs: dict | None = None):
    """(session, value names in topological order with their producing node) for the
    graph with every intermediate value as an output."""
    import onnxruntime as ort

    source = spec.path
    if mode == "optimized":
        source = folder / "optimized.onnx"
        ort.InferenceSession(str(spec.path), session_options(threads, None, source, configs),
                             providers=["CPUExecutionProvider"])
    model = onnx.load(str(source))
    outputs = {o.name for o in model.graph.output}
    values = []
    for node in model.graph.node:
        if node.op_type in SKIP_OPS:
            continue
        for name in node.output:
            if name and name not in outputs:
                values.append((name, node))
                model.graph.output.append(onnx.ValueInfoProto(name=name))
    path = folder / "instrumented.onnx"
    onnx.save(model, str(path), save_as_external_data=model.ByteSize() > 1.8e9,
              location="instrumented.onnx.data")
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL if mode == "optimized" else None
    session = ort.InferenceSession(str(path), session_options(threads, level, None, configs),
                                   providers=["CPUExecutionProvider"])
    return session, values


def row_axis(many: np.ndarray, one: np.ndarray, t: int) -> int | None:
    """The axis that is t long in the t-token call's value and 1 in a step's."""
    if many.ndim != one.ndim:
        return None
    axes = [a for a in range(many.ndim) if many.shape[a] != one.shape[a]]
    if len(axes) == 1 and many.shape[axes[0]] == t and one.shape[axes[0]] == 1:
        return axes[0]
    return None


def one_step(backend, cache, ids: list[int], j: int, step: str) -> np.ndarray:
    """Logits of ids[j], the cache holding ids[:j]: a one-token call ("T=1"); a two-token
    call of ids[j] twice, whose second row is dropped ("pad": the cache keeps one row, the
    stale one past its end is overwritten by the next call); or ids[j-1:j+1] over the
    cache rolled back by one row ("overlap": row j-1 is computed again, bit for bit when
    every call has two or more rows)."""
    if step == "T=1":
        return backend.forward(cache, [ids[j]], 1)[-1]
    if step == "pad":
        rows = backend.forward(cache, [ids[j], ids[j]], 2)[0]
        cache.rollback(cache.length - 1)
        return rows
    cache.rollback(cache.length - 1)
    return backend.forward(cache, ids[j - 1:j + 1], 1)[-1]


def run_both(backend, ids: list[int], t: int, capture: bool = True, step: str = "T=1"):
    """Values and logits of one t-token call and of t one-token steps after ids[:-t]
    (values: with step "T=1" only)."""
    split = len(ids) - t
    one = backend.new_cache(len(ids) + 1)
    backend.forward(one, ids[:split], 1)
    singles, single_logits = [], []
    for j in range(split, len(ids)):
        single_logits.append(one_step(backend, one, ids, j, step).copy())
        if capture:
            singles.append(backend.values())
    many_cache = backend.new_cache(len(ids) + 1)
    backend.forward(many_cache, ids[:split], 1)
    many_logits = backend.forward(many_cache, ids[split:], t).copy()
    many = backend.values() if capture else None
    kv = np.abs(one.planes[:, :, :, split:len(ids)] -
                many_cache.planes[:, :, :, split:len(ids)]).max()
    return many, singles, float(np.abs(many_logits - np.stack(single_logits)).max()), float(kv)


def compare(values, many, singles, t: int) -> list[tuple[str, object, float | None]]:
    """(value, node, max |diff| or None when not row-comparable) in topological order."""
    rows = []
    for name, node in values:
        m = many.get(name)
        if m is None or m.dtype.kind != "f":
            rows.append((name, node, None))
            continue
        axis = row_axis(m, singles[0][name], t)
        if axis is None:  # not per token (a shape, the cache, a length)
            rows.append((name, node, None))
            continue
        diff = max(float(np.abs(np.take(m, [i], axis=axis) - s[name]).max())
                   for i, s in enumerate(singles))
        rows.append((name, node, diff))
    return rows


def locate(spec: ModelSpec, ids_list: list[list[int]], t: int, mode: str,
           threads: int | None, top: int, configs: dict | None = None,
           local: bool = False) -> None:
    with tempfile.TemporaryDirectory() as folder:
        session, values = instrumented(spec, mode, threads, Path(folder), configs)
        backend = open_backend(spec, session, [v for v, _ in values])
        if local:
            many, singles, *_ = run_both(backend, ids_list[0], t)
            print("each node alone, fed the call's inputs (max |row - one-row call|):")
            found = local_check(Path(folder) / "instrumented.onnx", values, many, singles, t,
                                threads)
            for op, d in sorted(found.items(), key=lambda kv: -kv[1]):
                print(f"  {op:36s} {d:.3g}")
    for ids in ids_list:
        many, singles, logit_diff, kv_diff = run_both(backend, ids, t)
        rows = compare(values, many, singles, t)
        diffs = {name: d for name, _, d in rows}
        differing = [(name, node, d) for name, node, d in rows if d]
        print(f"\n{len(ids)} ids, T={t}: logits max|diff| {logit_diff:.3g}, new K/V rows "
              f"{kv_diff:.3g}; {len(differing)} of {sum(d is not None for *_, d in rows)} "
              "comparable values differ")
        for name, node, d in differing[:top]:
            print(f"  {node.op_type:28s} {d:10.3g}  {node.name or name}")
        # An input with diff None is a value without a row axis (the cache, a length, or a
        # portable graph's attention, which puts heads and rows on one axis): unknown.
        sources = [(name, node, d) for name, node, d in differing
                   if all(not diffs.get(i) for i in node.input)]
        unsure = sum(any(i in diffs and diffs[i] is None for i in node.input)
                     for _, node, _ in sources)
        print(f"  sources ({len(sources)}): output differs, every input identical"
              + (f" or not row-comparable ({unsure} of them)" if unsure else ""))
        by_op: dict[str, list[float]] = {}
        for _, node, d in sources:
            by_op.setdefault(node.op_type, []).append(d)
        for op, ds in sorted(by_op.items(), key=lambda kv: -max(kv[1])):
            print(f"    {op:28s} {len(ds):4d} nodes, max {max(ds):.3g}, median "
                  f"{statistics.median(ds):.3g}")
        for name, node, d in sources[:top]:
            print(f"    {node.op_type:28s} {d:10.3g}  {node.name or name}")


def local_check(model_path: Path, values, many, singles, t: int, threads: int | None,
                skip: tuple[str, ...] = ("GroupQueryAttention",)) -> dict[str, float]:
    """Each node alone: fed the t-token call's inputs, as one call and row by row, so that
    a node whose inputs already differ is still tested. Returns op type -> max |diff|."""
    import onnxruntime as ort

    model = onnx.load(str(model_path))
    inits = {i.name: i for i in model.graph.initializer}
    worst: dict[str, float] = {}
    for name, node in values:
        if node.op_type in skip or name != next(o for o in node.output if o):
            continue
        feeds = list(dict.fromkeys(i for i in node.input if i and i not in inits))
        if not feeds or any(i not in many for i in feeds):
            continue
        axes = [row_axis(many[i], singles[0][i], t) for i in feeds]
        if any(a is None for a in axes) or row_axis(many[name], singles[0][name], t) is None:
            continue
        graph = onnx.helper.make_graph(
            [node], "one",
            [onnx.helper.make_tensor_value_info(
                i, onnx.helper.np_dtype_to_tensor_dtype(many[i].dtype), None) for i in feeds],
            [onnx.ValueInfoProto(name=name)],
            [inits[i] for i in node.input if i in inits])
        one = onnx.helper.make_model(graph, opset_imports=model.opset_import,
                                     ir_version=model.ir_version)
        sess = ort.InferenceSession(
            one.SerializeToString(),
            session_options(threads, ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
            providers=["CPUExecutionProvider"])
        out_axis = row_axis(many[name], singles[0][name], t)
        whole = sess.run([name], {i: many[i] for i in feeds})[0]
        diff = 0.0
        for r in range(t):
            row = sess.run([name], {i: np.take(many[i], [r], axis=a)
                                    for i, a in zip(feeds, axes)})[0]
            diff = max(diff, float(np.abs(np.take(whole, [r], axis=out_axis) - row).max()))
        key = f"{node.op_type}" + (f" ({_attr(node, 'bits')}-bit, K={_attr(node, 'K')})"
                                   if node.op_type == "MatMulNBits" else "")
        worst[key] = max(worst.get(key, 0.0), diff)
    return worst


def tokenize(bundle_root: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bundle_root / "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


def tiny_bundle(precision: str, attention: str, folder: Path) -> Path:
    """A tiny random Llama (hidden 64, the smallest GroupQueryAttention takes) as a bundle."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from specedge.export.bundle_writer import export_bundle
    from specedge.gpu_check.tiny_checkpoints import save_tiny

    model = save_tiny(folder / "model", hidden_size=64, layers=2)
    out = folder / f"bundle-{precision}-{attention}"
    export_bundle(str(model), out, precision=precision, attention=attention)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["locate", "options"])
    parser.add_argument("bundle", nargs="?")
    parser.add_argument("--tiny", choices=["fp32", "int8", "int4"])
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--t", type=int, default=4, help="tokens of the call (locate)")
    parser.add_argument("--ts", type=int, nargs="+", default=[2, 4, 8],
                        help="tokens of the calls (options)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--graph", choices=["optimized", "source"], default="optimized")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local", action="store_true",
                        help="also test each node alone on the call's inputs")
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            root = tiny_bundle(args.tiny, args.attention, Path(tmp))
            ids_list = [[1] + [3 + (7 * i) % 30 for i in range(n)] for n in (11, 17)]
        else:
            root = Path(args.bundle).expanduser()
            # Prompts longer than the call: a prefix of at least one token stays cached.
            ids_list = [ids for ids in tokenize(root) if len(ids) > max(args.t, *args.ts)]
        bundle = load_bundle(root)
        spec = bundle.target
        print(f"{root}: precision {bundle.manifest['precision']}, kv_layout {spec.kv_layout}")
        if args.command == "locate":
            locate(spec, ids_list[:args.prompts], args.t, args.graph, args.threads, args.top,
                   local=args.local)
        else:
            options(spec, ids_list, args.ts, args.threads, args.rounds, Path(tmp),
                    args.variants)


def _set_attr(node: onnx.NodeProto, name: str, value: int) -> None:
    for a in node.attribute:
        if a.name == name:
            a.i = value
            return
    node.attribute.append(onnx.helper.make_attribute(name, value))


def _attr(node: onnx.NodeProto, name: str, default: int = 0) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def accuracy_level(level: int, bits: tuple[int, ...] = (4, 8)) -> Callable:
    """MatMulNBits of `bits` computed at `level` (1: fp32 activations, 4: int8)."""
    def edit(model: onnx.ModelProto) -> None:
        for node in model.graph.node:
            if node.op_type == "MatMulNBits" and _attr(node, "bits", 4) in bits:
                _set_attr(node, "accuracy_level", level)
    return edit


def eight_bit_containers(model: onnx.ModelProto) -> None:
    """Each 4-bit MatMulNBits as an 8-bit one holding the same codes and zero points (the
    same weights, twice the bytes): ONNX Runtime's 8-bit kernels give each row of an M-row
    call the one-row result."""
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or _attr(node, "bits", 4) != 4:
            continue
        n, k, block = _attr(node, "N"), _attr(node, "K"), _attr(node, "block_size")
        blocks = -(-k // block)
        packed = onnx.numpy_helper.to_array(inits[node.input[1]])  # [N, blocks, block/2]
        codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks, block)
        inits[node.input[1]].CopyFrom(onnx.numpy_helper.from_array(
            codes.astype(np.uint8), node.input[1]))
        if len(node.input) > 3 and node.input[3]:
            zp = onnx.numpy_helper.to_array(inits[node.input[3]]).reshape(n, -1)
            zp = np.stack([zp & 15, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks]
            inits[node.input[3]].CopyFrom(onnx.numpy_helper.from_array(
                np.ascontiguousarray(zp).astype(np.uint8).reshape(-1), node.input[3]))
        _set_attr(node, "bits", 8)


VARIANTS: dict[str, tuple[Callable | None, dict]] = {
    "as exported": (None, {}),
    "accuracy_level 1 (all)": (accuracy_level(1), {}),
    "accuracy_level 1 (4-bit only)": (accuracy_level(1, (4,)), {}),
    "4-bit codes in 8-bit MatMulNBits": (eight_bit_containers, {}),
    "one intra-op thread": (None, {"threads": 1}),
    # Runtime changes, the graph as exported: no call with one row.
    "pad one-token calls to two rows": (None, {"step": "pad"}),
    "overlap one-token calls by a row": (None, {"step": "overlap"}),
}


def decode_seconds(backend, ids: list[int], steps: int, step: str = "T=1") -> float:
    """Seconds per token of plain greedy decoding after `ids`, a token per `one_step`."""
    ids = list(ids)
    cache = backend.new_cache(len(ids) + steps + 2)
    ids.append(int(np.argmax(backend.forward(cache, ids, 1)[-1])))
    t0 = time.perf_counter()
    for _ in range(steps):
        ids.append(int(np.argmax(one_step(backend, cache, ids, len(ids) - 1, step))))
    return (time.perf_counter() - t0) / steps


def options(spec: ModelSpec, ids_list: list[list[int]], ts: list[int], threads: int | None,
            rounds: int, folder: Path, names: list[str] | None = None,
            steps: int = 48) -> None:
    """Each variant's max logit difference (a t-token call against t steps, every prompt
    with at least two tokens before them, each t in `ts`) and its plain decoding speed
    relative to the first variant, interleaved in one process, medians over rounds."""
    import dataclasses

    import onnxruntime as ort

    backends, sessions = {}, {}
    for name in names or list(VARIANTS):
        edit, extra = VARIANTS[name]
        path = spec.path
        if edit is not None:
            model = onnx.load(str(spec.path))
            edit(model)
            path = folder / f"variant{len(backends)}.onnx"
            onnx.save(model, str(path))
        key = (path, extra.get("threads", threads))
        if key not in sessions:
            session = ort.InferenceSession(
                str(path), session_options(key[1], None, None, extra.get("configs")),
                providers=["CPUExecutionProvider"])
            sessions[key] = open_backend(dataclasses.replace(spec, path=path), session)
        backends[name] = (sessions[key], extra.get("step", "T=1"))
        diff = max(run_both(sessions[key], ids, t, False, backends[name][1])[2]
                   for ids in ids_list for t in ts if len(ids) - t >= 2)
        print(f"{name:36s} max logit diff (T={','.join(map(str, ts))}) {diff:.3g}",
              flush=True)
    times: dict[str, list[float]] = {n: [] for n in backends}
    order = list(backends)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            backend, step = backends[name]
            times[name].append(decode_seconds(backend, ids_list[r % len(ids_list)], steps,
                                              step))
    base = times[order[0]]
    for name in order:
        ratios = [b / x for b, x in zip(base, times[name])]
        print(f"{name:36s} {1e3 * statistics.median(times[name]):7.2f} ms/token, speed "
              f"{statistics.median(ratios):.3f}x of {order[0]!r} (rounds: "
              f"{' '.join(f'{x:.2f}' for x in ratios)})")

if __name__ == "__main__":
    main()
