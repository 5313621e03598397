"""The one-row probe (runtime/one_row.py): a target's one-token steps run as one row only
where this machine computes them as the rows of a verification call, bit for bit; the
answer is kept per graph and machine and probed once."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from specedge.runtime import Generator
from specedge.runtime import one_row as one_row_module
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import load_bundle
from specedge.runtime.one_row import cpu_identity, one_row_is_exact


def test_fused_attention_one_row_steps_are_found_to_differ(tiny_fused_int4_bundle, tmp_path):
    """GroupQueryAttention's one-query path computes other rows (the negative control)."""
    backend = OrtCpuBackend(load_bundle(tiny_fused_int4_bundle).target)
    assert one_row_is_exact(backend, None, tmp_path / "probe.json") is False
    assert backend.one_token_as_two  # left as it was


def test_the_answer_is_kept_per_graph_and_probed_once(tiny_batched_bundle, tmp_path,
                                                      monkeypatch):
    bundle = tmp_path / "bundle"  # its own copy: the test changes the graph file's time
    shutil.copytree(tiny_batched_bundle, bundle)
    backend = OrtCpuBackend(load_bundle(bundle).target)
    cache = tmp_path / "probe.json"
    gone = f"{tmp_path / 'gone.onnx'} 1 2 | {cpu_identity()} | onnxruntime 1.0 | threads 2"
    cache.write_text(json.dumps({gone: True}))  # a graph file deleted since: dropped
    first = one_row_is_exact(backend, 2, cache)
    record = json.loads(cache.read_text())
    (key,), (value,) = record.keys(), record.values()
    assert value is first and cpu_identity() in key and "threads 2" in key

    def no_probe(backend):
        raise AssertionError("probed again")

    monkeypatch.setattr(one_row_module, "_probe", no_probe)
    assert one_row_is_exact(backend, 2, cache) is first
    with pytest.raises(AssertionError, match="probed again"):
        one_row_is_exact(backend, 1, cache)  # another thread count: another answer
    target = backend.spec.path
    stat = target.stat()
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # a re-exported graph
    with pytest.raises(AssertionError, match="probed again"):
        one_row_is_exact(backend, 2, cache)


def test_a_generator_runs_one_row_steps_only_where_probed_exact(tiny_batched_bundle,
                                                                tmp_path, monkeypatch):
    """The Generator's target takes the probe's answer, and greedy speculative decoding
    equals plain decoding either way."""
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    gen = Generator.from_bundle(tiny_batched_bundle, threads=1)
    exact = one_row_is_exact(OrtCpuBackend(gen.bundle.target, 1), 1)
    assert gen.target.one_token_as_two is not exact
    for prompt in ("hello world", "the cat sat"):
        plain = gen.generate(prompt, raw=True, max_new_tokens=24, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=24, drafter="model",
                            draft_tokens=3)
        assert spec.token_ids == plain.token_ids
