"""Phi-3, Granite, OLMo2 and StableLM: tiny random models with each family's features on
(tiny_models.py `tiny_more`) export and pass --verify, decode greedily as transformers'
generate does, decode speculatively as they decode plainly, with portable and fused
attention and at int8; what cannot be exact is refused."""

from __future__ import annotations

import pytest
import torch
from tiny_models import LONGROPE_ORIGINAL, MORE_ARCHITECTURES, save_tiny_more, tiny_more
from transformers import AutoModelForCausalLM

from specedge.export.bundle_writer import export_bundle
from specedge.export.graph.families import attention_form, kernel_rotates, model_dims_of
from specedge.export.graph.trace import wrap
from specedge.runtime import Generator

# A short prompt and one longer than Phi-3's sliding window (16), both ids of the tiny
# character vocabulary.
PROMPTS = ([1, 5, 6, 7, 8, 9, 10, 11, 4, 4], list(range(3, 33)))
NEW_TOKENS = 28
# Seeds whose models do not repeat one token on these prompts (a weak comparison).
SEEDS = {"granite": 2, "stablelm": 1}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("more")
    return {arch: save_tiny_more(root / arch, arch, seed=SEEDS.get(arch, 0))
            for arch in MORE_ARCHITECTURES}


@pytest.fixture(scope="module")
def draft_checkpoints(tmp_path_factory) -> dict:
    """A one-layer model of each family with the same tokenizer: a draft for `--draft`."""
    root = tmp_path_factory.mktemp("more-drafts")
    return {arch: save_tiny_more(root / arch, arch, layers=1, seed=5)
            for arch in MORE_ARCHITECTURES}


@pytest.fixture(scope="module")
def references(checkpoints) -> dict:
    """transformers' greedy generate, NEW_TOKENS per prompt, per family."""
    out = {}
    for arch, path in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            out[arch] = [model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                        do_sample=False)[0, len(ids):].tolist()
                         for ids in PROMPTS]
    return out


def _decode(bundle) -> list[tuple[list[int], list[int]]]:
    """(plain, speculative) greedy tokens for each prompt; the drafts are checked to have
    been accepted sometimes (else speculative equals plain trivially)."""
    gen = Generator.from_bundle(bundle)
    out, accepted = [], 0
    for ids in PROMPTS:
        plain = gen.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, use_draft=False)
        spec = gen.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_tokens=3)
        accepted += spec.stats["accepted_tokens"]
        out.append((plain.token_ids, spec.token_ids))
    assert accepted > 0
    return out


@pytest.mark.parametrize("attention", ["portable", "fused"])
@pytest.mark.parametrize("arch", MORE_ARCHITECTURES)
def test_family_exports_and_decodes_as_transformers(arch, attention, checkpoints, references,
                                                    tmp_path):
    """--verify passes for target and one-layer draft; plain greedy decoding of the bundle
    equals transformers' generate; speculative equals plain."""
    manifest = export_bundle(str(checkpoints[arch]), tmp_path / "b", draft_layers=1,
                             attention=attention, verify=True)
    for role in ("target", "draft"):
        report = manifest["verify"][role]
        assert report["ok"], report
        assert report["greedy_matches"] == report["greedy_steps"] == 32
    target = manifest["models"]["target"]
    assert target["architecture"] == arch
    assert target["kv_layout"] == ("bhsd-inplace" if attention == "fused" else "bhsd-fixed")
    assert manifest["models"]["draft"]["num_layers"] == 1
    for (plain, spec), ref in zip(_decode(tmp_path / "b"), references[arch]):
        assert plain == ref
        assert spec == plain


@pytest.mark.parametrize("arch", MORE_ARCHITECTURES)
def test_family_int8_exports_and_decodes(arch, checkpoints, draft_checkpoints, tmp_path):
    """int8 (batched attention by default), with a draft
    given by --draft, exports, stays close to fp32, and decodes; speculative equals plain
    on it."""
    manifest = export_bundle(str(checkpoints[arch]), tmp_path / "b",
                             draft=str(draft_checkpoints[arch]), precision="int8")
    assert manifest["models"]["target"]["kv_layout"] == "bhsd-inplace"
    assert manifest["models"]["draft"]["kv_layout"] == "bhsd-inplace"
    assert manifest["quantization"]["greedy_agreement"] >= 0.8
    assert manifest["quantization"]["batch_invariant"]
    for plain, spec in _decode(tmp_path / "b"):
        assert len(plain) == NEW_TOKENS
        assert spec == plain


@pytest.mark.parametrize("arch, kwargs, fused", [
    *[(arch, {}, fused) for arch in MORE_ARCHITECTURES for fused in (False, True)],
    *[(arch, {"hidden_size": 32}, fused) for arch in MORE_ARCHITECTURES
      for fused in (False, True)],
    ("stablelm", {"parallel": False}, False), ("stablelm", {"parallel": False}, True)])
def test_export_module_computes_what_transformers_computes(arch, kwargs, fused):
    """The export module, eagerly, against the model's own forward: a prompt call, then a
    call of several tokens over the cache (what a verification is), in portable and fused
    form. Covers variants not exported above: StableLM's sequential residual, and heads
    the kernel cannot rotate (hidden size 32: the graph rotates them, see below)."""
    model = tiny_more(arch, **kwargs)
    dims = model_dims_of(model.config)
    ids = torch.randint(3, 34, (1, 40), generator=torch.Generator().manual_seed(0))
    past = [torch.zeros(1, dims["num_kv_heads"], 48, dims["head_dim"])
            for _ in range(2 * dims["num_layers"])]
    module = wrap(model, attention="fused" if fused else "portable")
    with torch.no_grad():
        ref = model(ids).logits
        first, *rows = module(ids[:, :30], torch.arange(30)[None], torch.tensor([0]),
                              torch.tensor([30]), *past)
        if fused:  # the buffers come back written
            past = rows
        else:  # the new rows come back: the runtime writes them into its buffers
            for buf, new in zip(past, rows):
                buf[:, :, :30] = new
        second, *_ = module(ids[:, 30:], torch.arange(30, 40)[None], torch.tensor([30]),
                            torch.tensor([10]), *past)
    torch.testing.assert_close(first, ref[:, :30], atol=2e-4, rtol=0)
    torch.testing.assert_close(second, ref[:, 30:], atol=2e-4, rtol=0)


def test_dims_of_each_family(checkpoints):
    """model_dims_of reads each config: Phi-3 and StableLM have two heads of 64 here and
    one KV head; Granite and OLMo2 four heads of 16 and two KV heads."""
    from transformers import AutoConfig

    for arch, path in checkpoints.items():
        dims = model_dims_of(AutoConfig.from_pretrained(path))
        two_of_64 = arch in ("phi3", "stablelm")
        assert dims["num_layers"] == 2
        assert dims["num_kv_heads"] == (1 if two_of_64 else 2)
        assert dims["head_dim"] == (64 if two_of_64 else 16)
        assert dims["vocab_size"] == 34
        assert dims["max_context"] == (LONGROPE_ORIGINAL if arch == "phi3" else 512)


def test_phi3_longrope_context_stops_at_the_original_length(checkpoints, tmp_path):
    """Past original_max_position_embeddings transformers recomputes a Phi-3 sequence's
    whole cache with LongRoPE's long factors, which a bundle's cache cannot: the bundle
    holds sequences up to that length, and a generation that would go past it is refused.
    Without LongRoPE the context is the model's."""
    cfg = tiny_more("phi3").config
    assert cfg.max_position_embeddings > LONGROPE_ORIGINAL
    assert model_dims_of(cfg)["max_context"] == LONGROPE_ORIGINAL
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0,
                           "partial_rotary_factor": 0.75}
    assert model_dims_of(cfg)["max_context"] == cfg.max_position_embeddings
    export_bundle(str(checkpoints["phi3"]), tmp_path / "b")
    gen = Generator.from_bundle(tmp_path / "b")
    assert gen.bundle.target.max_context == LONGROPE_ORIGINAL
    with pytest.raises(ValueError):
        gen.generate(prompt_ids=PROMPTS[1], max_new_tokens=LONGROPE_ORIGINAL)


@pytest.mark.parametrize("arch, kwargs, rotary", [
    ("phi3", {"hidden_size": 32}, 24), ("stablelm", {"hidden_size": 32}, 8),
    ("granite", {"hidden_size": 32}, 8), ("olmo2", {"hidden_size": 32}, 8)])
def test_the_graph_rotates_where_the_kernel_cannot(arch, kwargs, rotary):
    """ONNX Runtime's GroupQueryAttention rotates a multiple of 16 dims of heads of a
    multiple of 16: a model without that (head size 32 with 24 rotary dims, or heads of 8)
    can have fused attention, with q and k rotated in the graph (whose
    eager form is checked against transformers above)."""
    cfg = tiny_more(arch, **kwargs).config
    dims = model_dims_of(cfg)
    rotated = int(dims["head_dim"] * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    assert rotated == rotary
    assert attention_form("fused", "int8", cfg) == "fused"
    assert attention_form("auto", "fp32", cfg) == "portable"
    assert not kernel_rotates(cfg)
    assert kernel_rotates(tiny_more(arch).config)


@pytest.mark.parametrize("arch", MORE_ARCHITECTURES)
def test_targets_export_the_features_a_feature_draft_reads(arch):
    """These families take feature drafts (tests/export/test_feature_draft_families.py): their
    graphs output the final norm's features beside the logits."""
    model = tiny_more(arch)
    module = wrap(model, features=True)
    ids = torch.tensor([[3, 4, 5]])
    dims = model_dims_of(model.config)
    past = [torch.zeros(1, dims["num_kv_heads"], 0, dims["head_dim"])] * (
        2 * model.config.num_hidden_layers)
    with torch.no_grad():
        out = module(ids, torch.arange(3).unsqueeze(0), torch.tensor([0]), torch.tensor([1]),
                     *past, torch.tensor([3]))
        final = model.model(ids).last_hidden_state  # after the final norm
    torch.testing.assert_close(out[-1], final, atol=1e-4, rtol=1e-4)
