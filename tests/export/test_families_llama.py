"""The Llama family with its variants: every rope scaling transformers ships (Llama 2 / 3.x),
sliding windows (Mistral, Qwen2 with per-layer `layer_types`) and Qwen3 (per-head q/k norms,
a head size from its config). For each, on a tiny random model with the feature on: the
export's --verify passes (prompt longer than the window), greedy decoding of the bundle equals
transformers' greedy generate, speculative decoding equals plain, and int8 exports and
decodes; portable and fused attention."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from tiny_models import BOS, EOS, VOCAB, _rare_eos, char_tokenizer

from specedge.export.bundle_writer import export_bundle
from specedge.export.graph.attention import attention_bias
from specedge.export.graph.families import layer_windows, model_dims_of
from specedge.export.graph.rotary import rope_type
from specedge.runtime import Generator

WINDOW = 8  # shorter than every prompt below
LONGROPE_SWITCH = 32  # original_max_position_embeddings: PROMPT + 24 tokens cross it
PROMPT = "the quick brown fox jumps"  # 25 tokens (one per character)
HALF = 8  # frequencies per head of size 16
ROPES = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    "longrope": dict(rope_type="longrope", factor=16.0,
                     original_max_position_embeddings=LONGROPE_SWITCH,
                     short_factor=[1.0 + 0.2 * i for i in range(HALF)],
                     long_factor=[3.0 + 1.5 * i for i in range(HALF)]),
}
VARIANTS = ("mistral", "qwen2", "qwen3")


def tiny_variant(name: str, seed: int = 0):
    """hidden 64, 2 layers, 4 heads, 2 KV heads, context 512. `llama-<scaling>`: Llama with
    that rope scaling; mistral: a window in both layers; qwen2: a window in its second layer
    only (`max_window_layers` 1); qwen3: the same, head size 32 (not 64 / 4) and q/k norm
    weights other than 1."""
    torch.manual_seed(seed)
    common = dict(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.3,
                  tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS)
    if name.startswith("llama-"):
        rope = dict(ROPES[name.removeprefix("llama-")], rope_theta=10000.0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(rope_parameters=rope, **common))
    elif name == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=WINDOW, **common))
    elif name == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW,
                                                   max_window_layers=1, **common))
    else:
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(use_sliding_window=True, sliding_window=WINDOW,
                                                   max_window_layers=1, head_dim=32, **common))
        with torch.no_grad():
            for name_, p in model.named_parameters():
                if "q_norm" in name_ or "k_norm" in name_:
                    p.normal_(1.0, 0.5)
    return _rare_eos(model.eval())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-family")
    out = {}
    for name in [f"llama-{k}" for k in ROPES] + list(VARIANTS):
        model = tiny_variant(name)
        model.generation_config.eos_token_id = EOS
        model.save_pretrained(root / name)
        char_tokenizer().save_pretrained(root / name)
        out[name] = root / name
    return out


def _prompt_ids() -> list[int]:
    return char_tokenizer()(PROMPT)["input_ids"]


_GREEDY: dict = {}  # transformers' greedy continuations, per checkpoint


def _transformers_greedy(path, ids: list[int], n: int) -> list[int]:
    if (path, n) not in _GREEDY:
        model = tf.AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 min_new_tokens=n)
        _GREEDY[path, n] = out[0, len(ids):].tolist()
    return _GREEDY[path, n]


def _decodes_as_transformers(path, bundle, n: int = 24) -> None:
    """Plain greedy decoding of the bundle equals transformers'; speculative equals plain."""
    ids = _prompt_ids()
    gen = Generator.from_bundle(bundle)
    plain = gen.generate(prompt_ids=ids, max_new_tokens=n, use_draft=False).token_ids
    assert len(plain) == n  # no early EOS: all n tokens compared
    assert plain == _transformers_greedy(path, ids, n)
    for k in (2, 4):
        assert gen.generate(prompt_ids=ids, max_new_tokens=n, draft_tokens=k).token_ids == plain


# The fused graph's tables (rotary.py `gqa_rotary_cache`) are one code path for every
# scaling but longrope's: yarn checks it with an attention factor other than 1, longrope
# its second set of rows.
@pytest.mark.parametrize("scaling, attention", [(k, "portable") for k in ROPES]
                         + [("yarn", "fused"), ("longrope", "fused")])
def test_rope_scaling_matches_transformers(scaling, attention, checkpoints, tmp_path):
    """Each scaling's tables equal transformers': --verify (a 62-token prompt in one call,
    past longrope's switch), then a 25-token prompt whose greedy continuation crosses the
    switch one token at a time, and speculative calls that straddle it. "dynamic" equals
    the unscaled tables within the model's context, which is the bundle's."""
    path = checkpoints[f"llama-{scaling}"]
    manifest = export_bundle(str(path), tmp_path / "b", draft_layers=1, attention=attention,
                             verify=True)
    assert all(r["ok"] for r in manifest["verify"].values())
    assert manifest["models"]["target"]["kv_layout"] == (
        "bhsd-inplace" if attention == "fused" else "bhsd-fixed")
    assert manifest["models"]["target"]["max_context"] == 512  # max_position_embeddings
    _decodes_as_transformers(path, tmp_path / "b")


@pytest.mark.parametrize("attention", ["portable", "fused"])
@pytest.mark.parametrize("arch", VARIANTS)
def test_window_and_qwen3_match_transformers(arch, attention, checkpoints, tmp_path):
    """Sliding windows honoured (prompt longer than the window) with the model's full
    context; Qwen3's q/k norms and head size; portable and fused."""
    path = checkpoints[arch]
    manifest = export_bundle(str(path), tmp_path / "b", draft_layers=1, attention=attention,
                             verify=True)
    assert all(r["ok"] for r in manifest["verify"].values())
    assert manifest["models"]["target"]["max_context"] == 512  # not capped at the window
    assert manifest["models"]["target"]["head_dim"] == (32 if arch == "qwen3" else 16)
    _decodes_as_transformers(path, tmp_path / "b")


@pytest.mark.parametrize("name", ["mistral", "qwen3", "llama-longrope"])
def test_int8_exports_and_decodes(name, checkpoints, tmp_path):
    """int8 picks fused attention (auto) and decodes; speculative equals plain."""
    manifest = export_bundle(str(checkpoints[name]), tmp_path / "b", draft_layers=1,
                             precision="int8")
    assert manifest["models"]["target"]["kv_layout"] == "bhsd-inplace"
    assert manifest["quantization"]["greedy_agreement"] >= 0.9
    gen = Generator.from_bundle(tmp_path / "b")
    ids = _prompt_ids()
    plain = gen.generate(prompt_ids=ids, max_new_tokens=24, use_draft=False).token_ids
    assert len(plain) == 24
    assert gen.generate(prompt_ids=ids, max_new_tokens=24, draft_tokens=3).token_ids == plain


def test_window_mask_is_transformers():
    """The additive masks with a window: query at past_length + t attends to key position j
    iff past_length + t - WINDOW < j <= past_length + t (transformers' sliding overlay)."""
    past_length, capacity, t, groups = 11, 16, 3, 2
    past, new = attention_bias(torch.tensor([past_length]), capacity, t, groups,
                               torch.float32, WINDOW)
    assert past.shape == (1, 1, groups * t, capacity) and new.shape == (groups * t, t)
    past = past[0, 0]
    for g in range(groups):
        for q in range(t):
            pos = past_length + q
            row = g * t + q
            for j in range(capacity):
                assert (past[row, j] == 0) == (j < past_length and j > pos - WINDOW)
            for s in range(t):
                assert (new[row, s] == 0) == (s <= q and past_length + s > pos - WINDOW)


def test_layer_windows_follow_the_config():
    assert layer_windows(tiny_variant("mistral").config) == [WINDOW, WINDOW]
    assert layer_windows(tiny_variant("qwen2").config) == [None, WINDOW]
    assert layer_windows(tiny_variant("llama-linear").config) == [None, None]
    cfg = tf.Qwen2Config(num_hidden_layers=2, sliding_window=WINDOW)  # use_sliding_window off
    assert layer_windows(cfg) == [None, None]
    assert model_dims_of(tiny_variant("mistral").config)["max_context"] == 512


def test_unknown_rope_scaling_is_refused():
    rotary = tiny_variant("llama-linear").model.rotary_emb
    rotary.rope_type = "proportional"
    with pytest.raises(ValueError, match="rope scaling 'proportional' is not supported"):
        rope_type(rotary)
