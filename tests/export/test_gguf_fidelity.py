"""A GGUF file exports as the model it holds: for each value transformers' GGUF reader drops
(rope scaling, partial rotary, sliding windows, soft-capping, Gemma 3's layer pattern,
StableLM's q/k norms, GPT-2's sizes, Qwen3's head size), a tiny model with it, written as
GGUF the way llama.cpp writes it, comes back from `resolve_checkpoint` with the original's
logits, where transformers' plain load gives another model; what cannot be rebuilt exactly
is refused with a message saying what to do; and a rewritten file is read again."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import transformers as tf
from gguf_writer import write_gguf
from test_gguf_families import NEW_TOKENS, PROMPT, bpe_tokenizer
from tiny_models import BOS, EOS, VOCAB, _rare_eos, tiny_model, tiny_more
from transformers import AutoModelForCausalLM

from specedge.export.bundle_writer import export_bundle
from specedge.export.gguf_config import complete_config, llama3_rope
from specedge.export.sources import resolve_checkpoint
from specedge.runtime import Generator

# Longer than every sliding window below, so that the windows apply.
IDS = torch.tensor([PROMPT + list(range(3, 34))])
COMMON = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.3, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0,
              tie_word_embeddings=False)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))


def _norms_and_biases(model, gemma: bool = False):
    """Norms and biases start at 1 (Gemma: 0) and 0: give them values that matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "norm" in name:
                p.normal_((2.0 if ".post_" in name else 0.0) if gemma else 1.0, 0.3)
    return _rare_eos(model.eval())


def llama(rope: dict):
    torch.manual_seed(0)
    return _norms_and_biases(tf.LlamaForCausalLM(tf.LlamaConfig(
        rope_parameters={"rope_theta": 500.0, **rope}, **COMMON)))


def gemma(arch: str):
    """Head size 8 and query scale 1/sqrt(8), as llama.cpp scales it; soft-capping small
    enough to bite; Gemma 3: sliding and global layers alternating (not Gemma3TextConfig's
    pattern), a local rope base and linear scaling on the global layers."""
    torch.manual_seed(1)
    common = dict(COMMON, head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
                  final_logit_softcapping=4.0, tie_word_embeddings=True, initializer_range=0.1,
                  num_hidden_layers=4)
    if arch == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(attn_logit_softcapping=2.0, **common))
    else:
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            sliding_window_pattern=2, rope_theta=1e5, rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0}, **common))
    return _norms_and_biases(model, gemma=True)


def case(name: str):
    """The original model of each case."""
    if name == "llama-linear":
        return llama({"rope_type": "linear", "factor": 4.0})
    if name == "llama3-rope":  # its four frequencies: one of each regime and one between
        return llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if name == "llama-yarn":
        return llama({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    if name == "qwen2-yarn":
        torch.manual_seed(0)
        return _norms_and_biases(tf.Qwen2ForCausalLM(tf.Qwen2Config(rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
            "original_max_position_embeddings": 128}, **COMMON)))
    if name == "qwen3-head-size":
        torch.manual_seed(0)
        return _norms_and_biases(tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **COMMON)))
    if name == "phi3-longrope":  # partial rotary 0.75, a window of 16, LongRoPE factors
        return tiny_more("phi3", hidden_size=32)
    if name == "phi3-partial":
        torch.manual_seed(0)
        return _norms_and_biases(tf.Phi3ForCausalLM(tf.Phi3Config(
            partial_rotary_factor=0.5, sliding_window=8, **COMMON)))
    if name in ("gemma2", "gemma3_text"):
        return gemma(name)
    if name == "stablelm":
        torch.manual_seed(0)
        return _norms_and_biases(tf.StableLmForCausalLM(tf.StableLmConfig(
            partial_rotary_factor=0.5, rope_theta=500.0, qk_layernorm=True,
            use_qkv_bias=True, use_parallel_residual=True, **COMMON)))
    if name == "gpt2":
        torch.manual_seed(0)
        return _rare_eos(tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=len(VOCAB), n_positions=256, n_embd=32, n_layer=2, n_head=4, n_inner=48,
            initializer_range=0.3, bos_token_id=BOS, eos_token_id=EOS)).eval())
    raise AssertionError(name)


def written(model, root, name: str = "model"):
    """`model` saved with the byte-level BPE tokenizer and written as an f32 GGUF file."""
    model.save_pretrained(root / f"{name}-checkpoint")
    bpe_tokenizer().save_pretrained(root / f"{name}-checkpoint")
    return write_gguf(root / f"{name}-checkpoint", root / f"{name}.gguf")


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


# Cases that transformers cannot even load from the file (a tensor shape differs).
NOT_LOADED = ("qwen3-head-size", "gpt2")
CASES = ("llama-linear", "llama3-rope", "llama-yarn", "qwen2-yarn", "qwen3-head-size",
         "phi3-longrope", "phi3-partial", "gemma2", "gemma3_text", "stablelm", "gpt2")


@pytest.mark.parametrize("name", CASES)
def test_gguf_reads_back_as_the_original_model(name, tmp_path):
    """The checkpoint resolved from the file gives the original's logits; transformers'
    own reading of the file does not (or cannot load it), so the case tests something."""
    model = case(name)
    path = written(model, tmp_path)
    want = logits(model)
    assert want.abs().max() > 1.0  # logits that say something
    checkpoint = resolve_checkpoint(str(path))
    got = logits(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval())
    assert (got - want).abs().max() < 1e-4
    def plain():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=torch.float32).eval()

    if name in NOT_LOADED:
        with pytest.raises(RuntimeError, match="mismatched_sizes"):
            plain()
    else:
        assert (logits(plain()) - want).abs().max() > 0.5


def test_gemma3_exports_and_decodes_as_the_original(tmp_path):
    """End to end through the bundle: sliding layers, both rope bases and soft-capping."""
    model = case("gemma3_text")
    path = written(model, tmp_path)
    export_bundle(str(path), tmp_path / "b")
    with torch.no_grad():
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=EOS, pad_token_id=0)
    want = want[0, len(PROMPT):].tolist()
    got = Generator.from_bundle(tmp_path / "b").generate(
        prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, use_draft=False).token_ids
    assert len(set(want)) > 3, want  # a generation that varies
    assert got == want


def test_rewritten_gguf_exports_the_new_model(tmp_path):
    """A GGUF file rewritten in place with other weights of the same size is read again,
    not taken from the cached checkpoint of the old file."""
    sizes = []
    for seed in (0, 1):
        model = tiny_model("llama", seed=seed)
        path = written(model, tmp_path)  # the same file, rewritten
        sizes.append(path.stat().st_size)
        export_bundle(str(path), tmp_path / "b")
        with torch.no_grad():
            want = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                                  eos_token_id=EOS, pad_token_id=0)[0, len(PROMPT):].tolist()
        got = Generator.from_bundle(tmp_path / "b").generate(
            prompt_ids=PROMPT, max_new_tokens=8, use_draft=False).token_ids
        assert got == want, seed
    assert sizes[0] == sizes[1]
    first = tiny_model("llama", seed=0)
    with torch.no_grad():  # the two models decode differently, so the check can fail
        assert first.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                              eos_token_id=EOS, pad_token_id=0)[0, len(PROMPT):].tolist() != want


def test_a_bundle_from_an_older_gguf_reader_is_not_up_to_date(tmp_path, monkeypatch):
    """The reader's revision is part of a GGUF bundle's export arguments: a bundle made by a
    reader that read the file differently is exported again."""
    from specedge.export import bundle_writer

    path = written(tiny_model("llama"), tmp_path)
    export_bundle(str(path), tmp_path / "b")
    assert bundle_writer.is_current(tmp_path / "b", bundle_writer.export_args(
        str(path), None, None, None, "fp32"))
    monkeypatch.setattr(bundle_writer, "GGUF_READER_REVISION",
                        bundle_writer.GGUF_READER_REVISION + 1)
    assert not bundle_writer.is_current(tmp_path / "b", bundle_writer.export_args(
        str(path), None, None, None, "fp32"))


def llama3_divisors(theta: float, head_dim: int, rope: dict) -> np.ndarray:
    """llama.cpp's rope_freqs for a Llama 3 scaling: transformers' base frequencies over
    its scaled ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tf.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                         rope_parameters={"rope_type": "llama3", "rope_theta": theta, **rope})
    scaled = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")[0].double().numpy()
    base = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    return (base / scaled).astype(np.float32)  # stored as f32


@pytest.mark.parametrize("theta, head_dim, rope, between", [
    (500000.0, 128, {"factor": 8.0, "high_freq_factor": 4.0}, 3),  # Llama 3.1's
    (500000.0, 128, {"factor": 32.0, "high_freq_factor": 4.0}, 3),  # Llama 3.2's
    (500.0, 8, {"factor": 8.0, "high_freq_factor": 4.0,  # the tiny model's: one between
                "original_max_position_embeddings": 64}, 1),
    (500.0, 8, {"factor": 8.0, "high_freq_factor": 1.01,  # none between
                "original_max_position_embeddings": 64}, 0),
])
def test_llama3_scaling_is_found_from_its_frequencies(theta, head_dim, rope, between):
    """From the f32 tensor alone, parameters that give the same frequencies, whether many,
    one or none of them lie between the two regimes."""
    rope = {"low_freq_factor": 1.0, "original_max_position_embeddings": 8192, **rope}
    divisors = llama3_divisors(theta, head_dim, rope)
    inside = ((divisors > 1.0001) & (divisors < rope["factor"] * 0.9999)).sum()
    assert inside >= between if between == 3 else inside == between
    found = llama3_rope(theta, divisors)
    assert found["factor"] == pytest.approx(rope["factor"])
    assert np.allclose(llama3_divisors(theta, head_dim, found), divisors, rtol=1e-5)
    if between == 3:
        assert found["original_max_position_embeddings"] == 8192
    assert llama3_rope(theta, np.ones(head_dim // 2)) == {}  # no scaling at all


def test_other_rope_frequencies_are_refused():
    """A rope_freqs tensor that no Llama 3 scaling gives (one frequency between the regimes
    moved by 1%), or one beside another scaling, is refused."""
    divisors = llama3_divisors(500000.0, 128, {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    between = np.flatnonzero((divisors > 1.001) & (divisors < 7.99))
    divisors[between[len(between) // 2]] *= 1.01
    keys = _keys("llama", **{"rope.freq_base": 500000.0})
    with pytest.raises(ValueError) as info:
        complete_config(LLAMA, keys, {"rope_freqs.weight": divisors}, set())
    message = str(info.value)
    assert "uses a rope_freqs tensor that is not Llama 3 rope scaling" in message
    assert "export the model from its Hugging Face checkpoint" in message
    linear = _keys("llama", **{"rope.scaling.type": "linear"})
    with pytest.raises(ValueError, match="not Llama 3 rope scaling"):  # two scalings
        complete_config(LLAMA, linear, {"rope_freqs.weight": np.ones(4)}, set())


def test_a_refused_file_is_one_line_through_the_command(tmp_path, capsys):
    """A Llama file whose rope_freqs no Llama 3 scaling gives (long and short wavelengths
    out of order): `specedge export` prints the refusal on one line, exits with status 2,
    and caches no checkpoint."""
    from gguf import GGUFReader

    from specedge.cli import main

    path = written(case("llama3-rope"), tmp_path)
    reader = GGUFReader(path, "r+")
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    freqs.data[:] = [1.0, 8.0, 1.0, 8.0]
    reader.data.flush()
    del reader, freqs
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["export", str(path), "--out", str(tmp_path / "b")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not Llama 3 rope scaling" in err[0], err
    assert "export the model from its Hugging Face checkpoint" in err[0]
    assert not list((tmp_path / "cache" / "checkpoints").glob("*"))


def _keys(arch: str, **keys) -> dict:
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in keys.items()}}


LLAMA = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
         "max_position_embeddings": 512, "rope_parameters": {"rope_theta": 1e4}}


FACTORS = {"rope_factors_long.weight": np.ones(4), "rope_factors_short.weight": np.ones(4)}


@pytest.mark.parametrize("keys, tensors, what", [
    (_keys("llama", **{"rope.scaling.type": "longrope"}), {}, "rope scaling 'longrope'"),
    (_keys("llama", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 2.0,
                       "rope.scaling.original_context_length": 64,
                       "rope.scaling.yarn_log_multiplier": 0.1}), {},
     "YaRN with yarn_log_multiplier"),
    (_keys("llama"), FACTORS, "rope factor tensors other than Phi-3's LongRoPE pair"),
    (_keys("phi3"), {"rope_factors_long.weight": np.ones(4)},
     "rope factor tensors other than Phi-3's LongRoPE pair"),
    (_keys("phi3"), FACTORS, "LongRoPE without rope.scaling.original_context_length"),
])
def test_what_has_no_config_form_is_refused(keys, tensors, what):
    with pytest.raises(ValueError) as info:
        complete_config(LLAMA, keys, tensors, set())
    assert f"uses {what}, which cannot be rebuilt exactly from the file: export the model " \
        "from its Hugging Face checkpoint (folder or Hub id) instead" in str(info.value)


def test_gemma_query_scale_and_layers_as_llama_cpp_reads_them():
    """llama.cpp scales queries by 1/sqrt(hidden / heads) for the 27B models (by layer
    count) and by 1/sqrt(head size) otherwise; a Gemma 3 file without a window has no
    sliding layers, and one without a pattern llama.cpp's period of 6."""
    gemma2 = {"model_type": "gemma2", "hidden_size": 4608, "num_attention_heads": 32,
              "head_dim": 128, "num_hidden_layers": 46, "rope_parameters": {}}
    assert complete_config(gemma2, _keys("gemma2"), {}, set())["query_pre_attn_scalar"] == 144
    assert complete_config(dict(gemma2, num_hidden_layers=42), _keys("gemma2"), {},
                           set())["query_pre_attn_scalar"] == 128
    gemma3 = dict(gemma2, model_type="gemma3_text", num_hidden_layers=7)
    none = complete_config(gemma3, _keys("gemma3"), {}, set())
    assert none["layer_types"] == ["full_attention"] * 7 and none["sliding_window"] is None
    period = complete_config(gemma3, _keys("gemma3", **{"attention.sliding_window": 512}), {},
                             set())["layer_types"]
    assert period == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert none["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0


def test_cache_name_follows_the_file(tmp_path):
    """Same size, another modification time: another cache folder."""
    from specedge.export.sources import gguf_cache_name

    path = tmp_path / "m.gguf"
    path.write_bytes(b"a" * 8)
    first = gguf_cache_name(path)
    path.write_bytes(b"b" * 8)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1000))
    assert gguf_cache_name(path) != first and first.startswith("m-8-")
