"""Quantized bundles are batch invariant: each row of a (K+1)-token target call equals the
one-token step at that position bit for bit, so greedy speculative output equals plain
greedy output token for token at int8 and int4 too.

ONNX Runtime computes a one-row call on other kernel paths than the rows of a multi-row call
(GroupQueryAttention; 4-bit MatMulNBits on some CPUs), and int8 activations grow the 1e-7
difference to about a logit; the target backend runs a one-token step as two rows
(ort_cpu.py, docs/design.md#batch-invariance-of-quantized-graphs). On fused graphs a
one-row call differs (`test_one_row_steps_differ_on_a_fused_graph`); on batched ones, the
default, it does on some CPUs only.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_rows import steps_against_one_call
from tiny_models import GEMMA_ARCHITECTURES, MORE_ARCHITECTURES, save_tiny_gemma, save_tiny_more

from specedge.export.bundle_writer import export_bundle
from specedge.prompts import load_prompts
from specedge.runtime import Generator
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import load_bundle


@pytest.fixture(scope="module", params=["int4", "int8"])
def tiny_quantized(request, tiny_checkpoints, tmp_path_factory):
    """The tiny Llama with head size 16 (GroupQueryAttention), quantized, fused attention."""
    out = tmp_path_factory.mktemp("invariant") / request.param
    manifest = export_bundle(str(tiny_checkpoints["llama-h16"]), out, draft_layers=1,
                             precision=request.param, attention="fused")
    return out, manifest


@pytest.mark.parametrize("t", [2, 3, 5, 9])
def test_tiny_rows_equal_one_token_steps_bit_for_bit(tiny_quantized, t):
    bundle, _ = tiny_quantized
    spec = load_bundle(bundle).target
    prompt = list(range(3, 20))
    new = [int(x) for x in np.random.default_rng(t).integers(3, spec.vocab_size, t)]
    assert steps_against_one_call(OrtCpuBackend(spec), prompt, new) == 0.0


def test_one_row_steps_differ_on_a_fused_graph(tiny_quantized):
    """The negative control: without the two-row step, GroupQueryAttention's one-query
    path computes other rows than a multi-row call's."""
    bundle, _ = tiny_quantized
    spec = load_bundle(bundle).target
    prompt = list(range(3, 23))
    rng = np.random.default_rng(0)
    unpadded = [steps_against_one_call(
        OrtCpuBackend(spec, one_token_as_two=False), prompt,
        [int(x) for x in rng.integers(3, spec.vocab_size, t)]) for t in (2, 5)]
    assert max(unpadded) > 0.0


def test_tiny_export_records_batch_invariance(tiny_quantized):
    _, manifest = tiny_quantized
    quantization = manifest["quantization"]
    assert quantization["batch_max_logit_diff"] == 0.0
    assert quantization["batch_invariant"] is True


def test_one_token_steps_leave_the_cache_as_one_row(tiny_quantized):
    """A padded step counts one row; the second is written past the counted rows and
    overwritten by the next step."""
    bundle, _ = tiny_quantized
    backend = OrtCpuBackend(load_bundle(bundle).target)
    cache = backend.new_cache(8)
    assert cache.spare == 1 and cache.planes.shape[3] == 9
    backend.forward(cache, [5, 6, 7], 1)
    for length in range(4, 9):
        backend.forward(cache, [9], 1)
        assert cache.length == length
    with pytest.raises(ValueError, match="KV cache full"):
        backend.forward(cache, [9], 1)


# Every family's tiny model; "phi3-h32" has heads of 32 with 24 rotary dims, which the kernel
# cannot rotate (the graph rotates q and k before it, as for Gemma).
FAMILIES = ("llama", "qwen2", "mistral", "gpt2", *GEMMA_ARCHITECTURES, *MORE_ARCHITECTURES,
            "phi3-h32")


@pytest.fixture(scope="module")
def family_checkpoints(tiny_checkpoints, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    out = {arch: tiny_checkpoints[arch] for arch in ("llama", "qwen2", "mistral", "gpt2")}
    out |= {arch: save_tiny_gemma(root / arch, arch) for arch in GEMMA_ARCHITECTURES}
    out |= {arch: save_tiny_more(root / arch, arch) for arch in MORE_ARCHITECTURES}
    out["phi3-h32"] = save_tiny_more(root / "phi3-h32", "phi3", hidden_size=32)
    return out


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_is_batch_invariant_at_its_default_attention(
        arch, precision, family_checkpoints, tmp_path):
    """`--attention auto` at int8/int4 gives every family batched attention, whose rows equal
    the one-token steps bit for bit; so greedy speculative decoding equals plain. (Whether
    a one-row call also equals them depends on the CPU's kernels: on fused graphs it does
    not, `test_fused_attention.py`; on batched ones it does on some CPUs.)"""
    manifest = export_bundle(str(family_checkpoints[arch]), tmp_path / "b", draft_layers=1,
                             precision=precision)
    assert manifest["models"]["target"]["attention"] == "batched"
    assert manifest["quantization"]["batch_max_logit_diff"] == 0.0
    spec = load_bundle(tmp_path / "b").target
    prompt = list(range(3, 23))
    rng = np.random.default_rng(0)
    for t in (2, 5):
        new = [int(x) for x in rng.integers(3, spec.vocab_size, t)]
        assert steps_against_one_call(OrtCpuBackend(spec), prompt, new) == 0.0
    gen = Generator.from_bundle(tmp_path / "b")
    drafted = 0
    for ids in (prompt, list(range(5, 30, 2))):
        plain = gen.generate(prompt_ids=ids, max_new_tokens=24, use_draft=False)
        spec_out = gen.generate(prompt_ids=ids, max_new_tokens=24, draft_tokens=3,
                                drafter="model")
        assert spec_out.token_ids == plain.token_ids
        drafted += spec_out.stats["draft_calls"]
    assert drafted > 0


SMOLLM2_PROMPTS = [p["prompt"] for p in load_prompts()]


def _smollm2_rows(bundle) -> None:
    gen = Generator.from_bundle(bundle, threads=2)
    for prompt in SMOLLM2_PROMPTS[::7][:5]:
        ids = gen.encode_prompt(prompt)
        path = gen.generate(prompt_ids=ids, max_new_tokens=6, use_draft=False).token_ids
        assert steps_against_one_call(gen.target, ids, path[:5]) == 0.0, prompt


def _smollm2_greedy(bundle) -> None:
    """8 prompts over the prompt set's categories x 96 tokens."""
    gen = Generator.from_bundle(bundle, threads=2)
    drafted = 0
    for prompt in SMOLLM2_PROMPTS[::4][:8]:
        plain = gen.generate(prompt, max_new_tokens=96, use_draft=False)
        spec = gen.generate(prompt, max_new_tokens=96, draft_tokens=3)
        assert spec.token_ids == plain.token_ids, prompt
        drafted += spec.stats["accepted_tokens"]
    assert drafted > 0  # verification calls of several rows did happen


def test_smollm2_int8_rows_equal_one_token_steps(smollm2_int8_bundle):
    _smollm2_rows(smollm2_int8_bundle)


def test_smollm2_int4_rows_equal_one_token_steps(smollm2_int4_feature_bundle):
    _smollm2_rows(smollm2_int4_feature_bundle)


def test_smollm2_int8_greedy_speculative_equals_plain(smollm2_int8_bundle):
    _smollm2_greedy(smollm2_int8_bundle)


def test_smollm2_int4_greedy_speculative_equals_plain(smollm2_int4_feature_bundle):
    _smollm2_greedy(smollm2_int4_feature_bundle)
