"""Whether a target's one-token step may run as one row on this machine.

A batched graph computes a row alike in every call of two tokens or more, but a call of one
row may take other kernel paths (4-bit MatMulNBits' one-row path on some CPUs; on fused
graphs, GroupQueryAttention's one-query path), and int8 activations grow their 1e-7
difference to about a logit. So the ort-cpu backend runs a target's one-token step as two
rows, the token twice (ort_cpu.py `one_token_as_two`), which costs about 10% of a plain step
(docs/design.md, "Batch invariance of quantized graphs"). Where this machine's kernels
compute a one-row call as they compute a row of a larger one, the second row buys nothing.

`one_row_is_exact` measures that on the bundle's own target graph, bit for bit, over the
calls the loop makes: one-token steps after a prompt against the rows of one call of 2 and
of AUTO_MAX_K + 1 tokens over the same tokens, at three cache lengths (PROBE_LENGTHS, as
far as the context allows). Kernels take their path
by the call's shape, not by the values, so random tokens show a second path where there is
one. The answer is kept in the specedge cache (user_cache.py) under the graph file, the CPU
(its name and instruction sets), the ONNX Runtime version and the thread count, so the
probe (about 40 calls, about a second for SmolLM2-135M int4 on 2 cores) runs once a
machine.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import numpy as np

from specedge.runtime.atomic_files import atomic_write
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.config import AUTO_MAX_K
from specedge.runtime.drafting.auto_k_file import cpu_name
from specedge.runtime.user_cache import cache_root

FILE = "one_row.json"
PROBE_LENGTHS = (13, 70, 400)  # cache lengths before the probed steps


def one_row_is_exact(backend: OrtCpuBackend, threads: int | None,
                     cache: Path | None = None) -> bool:
    """Whether `backend`'s one-row one-token calls compute, bit for bit, the rows of its calls
    of several tokens (module docstring); from `cache` (a JSON file, default the specedge
    cache's FILE) when this graph was probed on this machine before."""
    path = cache or cache_root() / FILE
    key = _key(backend, threads)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), bool):
        return known[key]
    exact = _probe(backend)
    # Answers for graph files that are gone (re-exported, deleted) go with this write.
    kept = {k: v for k, v in known.items() if Path(k.split(" | ")[0].rsplit(" ", 2)[0]).exists()}
    try:
        atomic_write(path, json.dumps({**kept, key: exact}, indent=1))
    except OSError:
        pass  # a read-only cache: probe again next time
    return exact


def _probe(backend: OrtCpuBackend) -> bool:
    spec, two_rows = backend.spec, backend.one_token_as_two
    rng = np.random.default_rng(0)
    try:
        for length in PROBE_LENGTHS:
            if length + AUTO_MAX_K + 2 > spec.max_context:
                continue
            prompt = rng.integers(3, spec.vocab_size, length).tolist()
            new = rng.integers(3, spec.vocab_size, AUTO_MAX_K + 1).tolist()
            backend.one_token_as_two = True  # the caches' spare row, as the loop's
            steps = backend.new_cache(length + len(new) + 1)
            backend.forward(steps, prompt, 1)
            backend.one_token_as_two = False
            singles = np.stack([backend.forward(steps, [t], 1)[-1].copy() for t in new])
            backend.one_token_as_two = True
            for t in (2, len(new)):
                call = backend.new_cache(length + len(new) + 1)
                backend.forward(call, prompt, 1)
                if not np.array_equal(backend.forward(call, new[:t], t), singles[:t]):
                    return False
        return True
    finally:
        backend.one_token_as_two = two_rows


def _key(backend: OrtCpuBackend, threads: int | None) -> str:
    """The graph file (path, size, modification time), the CPU, ONNX Runtime, threads."""
    import onnxruntime

    graph = Path(backend.spec.path).resolve()
    stat = graph.stat()
    return " | ".join([f"{graph} {stat.st_size} {stat.st_mtime_ns}", cpu_identity(),
                       f"onnxruntime {onnxruntime.__version__}", f"threads {threads}"])


def cpu_identity() -> str:
    """The CPU's name and a digest of its instruction sets (/proc/cpuinfo's flags, or
    Features on aarch64): virtual machines often report one name for CPUs of several
    kinds."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12] if flags else platform.machine()
    return f"{cpu_name()} [{digest}]"
