"""A GGUF file of every exported family that transformers reads from GGUF exports: a tiny
random model, written as GGUF by scripts/experiments/gguf_writer.py the way llama.cpp writes it,
loads back in transformers with the same logits, and `specedge export FILE.gguf --verify`
gives a bundle whose greedy decoding is transformers' (on the original model).

The tiny models here keep the config classes' defaults for the values transformers' own GGUF
reader does not read back (soft-capping, partial rotary, sliding patterns, ...), so that this
file tests the writer and the architectures; export/gguf_config.py completes those
values from the file's keys, and tests/export/test_gguf_fidelity.py tests each of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from gguf_writer import GGUF_ARCHITECTURES, write_gguf
from tiny_models import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    SPECIALS,
    VOCAB,
    _rare_eos,
    char_tokenizer,
    tiny_model,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from specedge.export.bundle_writer import export_bundle
from specedge.export.graph.families import SUPPORTED_ARCHITECTURES
from specedge.runtime import Generator

PROMPT = [BOS, 22, 33, 29, 5, 3, 22, 30, 18, 10]
NEW_TOKENS = 24
# Our families that transformers 5.24 cannot load from a GGUF file (not in its GGUF
# architecture list).
NOT_READ_BY_TRANSFORMERS = ("granite", "olmo2")


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly len(VOCAB) tokens (the tiny models' vocabulary): the
    specials, 29 characters in GPT-2's byte alphabet (Ġ is the space) and two merges.
    transformers rebuilds a GGUF `gpt2` tokenizer from tokens and merges only."""
    chars = list("abcdefghijklmnopqrstuvwxyz") + ["Ġ", ".", ","]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars + ["Ġt", "he"])}
    assert len(vocab) == len(VOCAB)
    tok = Tokenizer(models.BPE(vocab, [("Ġ", "t"), ("h", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Seeds whose models do not repeat one token on PROMPT (a weak comparison).
SEEDS = {"gemma2": 1}


def tiny(arch: str):
    """A tiny random model of `arch` whose config transformers can read back from GGUF."""
    if arch in ("llama", "mistral", "qwen2"):
        return tiny_model(arch)
    if arch == "gpt2":  # transformers' GGUF reader leaves n_positions at GPT2Config's 1024
        return tiny_model(arch, max_positions=1024)
    torch.manual_seed(SEEDS.get(arch, 0))
    common = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.3, bos_token_id=BOS,
                  eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    if arch == "qwen3":  # head_dim stays Qwen3Config's 128 (other sizes: test_gguf_fidelity)
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common))
    elif arch == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**common))
    elif arch == "stablelm":  # partial rotary 0.25 and rope base 10000: StableLmConfig's
        model = tf.StableLmForCausalLM(tf.StableLmConfig(use_qkv_bias=True, **common))
    elif arch == "gemma2":  # soft-capping and query scale 256: Gemma2Config's, which
        # llama.cpp takes for a head size of 256 (it scales by the head size)
        common.update(head_dim=256, sliding_window=4, tie_word_embeddings=True,
                      initializer_range=0.1)
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**common))
    elif arch == "gemma3_text":  # Gemma3TextConfig's layer pattern: both layers sliding
        common.update(head_dim=256, sliding_window=4, tie_word_embeddings=True,
                      initializer_range=0.1)
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common))
    else:
        raise AssertionError(arch)
    with torch.no_grad():  # norms and biases start at 1 and 0: give them values to apply
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "norm" in name and "gemma" in arch:  # (1 + w) norms; see tiny_gemma
                p.normal_(2.0 if ".post_" in name else 0.0, 0.3)
            elif "norm" in name:
                p.normal_(1.0, 0.3)
    return _rare_eos(model.eval())


READ_FROM_GGUF = tuple(a for a in SUPPORTED_ARCHITECTURES if a not in NOT_READ_BY_TRANSFORMERS)


def test_the_writer_covers_every_family_transformers_reads():
    """The architectures tested here are exactly ours minus the two transformers cannot
    read, and the writer supports each."""
    assert set(READ_FROM_GGUF) == set(GGUF_ARCHITECTURES)
    for arch in NOT_READ_BY_TRANSFORMERS:
        assert arch not in GGUF_SUPPORTED_ARCHITECTURES
    for arch in READ_FROM_GGUF:
        assert arch.removesuffix("_text") in GGUF_SUPPORTED_ARCHITECTURES


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """arch -> (original model, checkpoint folder, GGUF file)."""
    out = {}
    for arch in READ_FROM_GGUF:
        root = tmp_path_factory.mktemp(arch)
        model = tiny(arch)
        model.generation_config.eos_token_id = EOS
        model.save_pretrained(root / "checkpoint")
        bpe_tokenizer().save_pretrained(root / "checkpoint")
        out[arch] = (model, root / "checkpoint",
                     write_gguf(root / "checkpoint", root / "gguf" / f"tiny-{arch}.gguf"))
    return out


def _load_gguf(path):
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32).eval()


def _greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=EOS, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", READ_FROM_GGUF)
def test_transformers_reads_the_file_back(arch, written):
    """Same logits as the original model (f32 weights: up to float rounding), and the same
    tokenizer ids."""
    model, _, path = written[arch]
    loaded = _load_gguf(path)
    # Mistral has no llama.cpp architecture: its file reads back as Llama, which computes
    # the same (transformers' own Mistral path cannot map a gguf 0.19 file's tensors).
    assert loaded.config.model_type == ("llama" if arch == "mistral" else arch)
    ids = torch.tensor([PROMPT + list(range(3, 34))])
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids).logits
    assert want.abs().max() > 1.0  # logits that say something
    assert (want - got).abs().max() < 1e-5
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert tokenizer.encode("the cat, then a dot.") == \
        bpe_tokenizer().encode("the cat, then a dot.")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS, EOS)


@pytest.mark.parametrize("arch", READ_FROM_GGUF)
def test_gguf_exports_and_decodes_as_transformers(arch, written, tmp_path, monkeypatch):
    """`specedge export FILE.gguf --draft-layers 1 --verify` passes, and the bundle's greedy
    decoding, plain and speculative, is transformers' on the original model."""
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))
    model, _, path = written[arch]
    manifest = export_bundle(str(path), tmp_path / "b", draft_layers=1, verify=True)
    for role in ("target", "draft"):
        assert manifest["verify"][role]["ok"], manifest["verify"][role]
    assert manifest["models"]["target"]["architecture"] == \
        ("llama" if arch == "mistral" else arch)
    want = _greedy(model, PROMPT)
    gen = Generator.from_bundle(tmp_path / "b")
    plain = gen.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, use_draft=False)
    spec = gen.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, draft_tokens=3)
    assert len(want) == NEW_TOKENS and len(set(want)) > 3, want  # a generation that varies
    assert plain.token_ids == want
    assert spec.token_ids == want


@pytest.mark.parametrize("quant", ["f16", "q8_0", "q4_1"])
def test_quantized_file_reads_back_as_the_rounded_model(quant, written, tmp_path):
    """A quantized file stores every 2-D weight on its grid (the llama q/k rows permuted
    first, which moves whole rows, so the blocks are the same), the output tensor of a
    4-bit file on Q8_0's, as llama.cpp keeps it: it loads back as the original model with
    each weight rounded to its grid."""
    from gguf import GGMLQuantizationType, GGUFReader, dequantize, quantize

    model, checkpoint, f32_path = written["llama"]
    path = write_gguf(checkpoint, tmp_path / f"{quant}.gguf", quant=quant)
    kind = GGMLQuantizationType[quant.upper()]
    head = GGMLQuantizationType.Q8_0 if quant == "q4_1" else kind
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert types["output.weight"] == head and types["token_embd.weight"] == kind
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == kind
    assert types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32
    rounded = tiny("llama")
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            grid = head if name == "lm_head.weight" else kind
            if p.dim() == 2 and grid == GGMLQuantizationType.F16:
                p.copy_(p.half().float())
            elif p.dim() == 2:
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), grid), grid)))
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want, got, exact = rounded(ids).logits, _load_gguf(path)(ids).logits, model(ids).logits
    assert (want - got).abs().max() < 1e-5
    assert (exact - got).abs().max() > 1e-4  # the rounding is there


def test_tied_head_of_a_4_bit_file_stays_at_8_bits(written, tmp_path):
    """With the head tied to the embedding table (no output tensor), the table is the output
    tensor, kept at Q8_0."""
    from gguf import GGMLQuantizationType, GGUFReader

    path = write_gguf(written["gemma2"][1], tmp_path / "q4.gguf", quant="q4_0")
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert "output.weight" not in types
    assert types["token_embd.weight"] == GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q4_0


def test_vocabulary_beyond_the_tokenizer_is_padded(tmp_path):
    """A model whose embedding table is larger than its tokenizer (as Qwen's are) gets
    llama.cpp's unused `[PAD<id>]` tokens up to its size, and reads back the same."""
    from gguf import GGUFReader

    model = tiny_model("llama", vocab_size=len(VOCAB) + 6)
    model.save_pretrained(tmp_path / "checkpoint")
    bpe_tokenizer().save_pretrained(tmp_path / "checkpoint")
    path = write_gguf(tmp_path / "checkpoint", tmp_path / "padded.gguf")
    fields = GGUFReader(path).fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in fields["tokenizer.ggml.tokens"].data]
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in fields["tokenizer.ggml.token_type"].data]
    assert tokens[:3] == SPECIALS and tokens[-6:] == [f"[PAD{i}]" for i in range(34, 40)]
    assert types[:3] == [3, 3, 3] and types[3:34] == [1] * 31 and types[34:] == [5] * 6
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert (model(ids).logits - _load_gguf(path)(ids).logits).abs().max() < 1e-5


def _fields(path) -> dict:
    """The file's scalar and string metadata, and its small tensors as arrays."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    out = {}
    for key, field in reader.fields.items():
        if field.types[0] == GGUFValueType.STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode()
        elif field.types[0] != GGUFValueType.ARRAY:
            out[key] = field.parts[field.data[0]].tolist()[0]
    out.update({t.name: np.array(t.data) for t in reader.tensors if t.name.startswith("rope")})
    return out


def test_rope_scaling_is_written_as_llama_cpp_reads_it(tmp_path):
    """Linear and YaRN scaling become `rope.scaling.*` keys; Llama 3's becomes llama.cpp's
    `rope_freqs` tensor, whose entries divide the base frequencies into exactly the ones
    transformers' llama3 scaling computes; scalings llama.cpp has no form for are refused.
    (transformers reads none of these back: docs/export.md.)"""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def written(name: str, rope: dict):
        cfg = tf.LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=4,
                             rope_parameters={"rope_theta": 500.0, **rope})
        tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / name)
        bpe_tokenizer().save_pretrained(tmp_path / name)
        return cfg, _fields(write_gguf(tmp_path / name, tmp_path / f"{name}.gguf"))

    _, linear = written("linear", {"rope_type": "linear", "factor": 4.0})
    assert linear["llama.rope.scaling.type"] == "linear"
    assert linear["llama.rope.scaling.factor"] == 4.0
    _, yarn = written("yarn", {"rope_type": "yarn", "factor": 2.0,
                               "original_max_position_embeddings": 256})
    assert yarn["llama.rope.scaling.type"] == "yarn"
    assert yarn["llama.rope.scaling.original_context_length"] == 256
    cfg, llama3 = written("llama3", {"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / 500.0 ** (np.arange(0, 8, 2) / 8)
    assert np.allclose(base / llama3["rope_freqs.weight"], scaled.numpy(), rtol=1e-6)
    factors = set(llama3["rope_freqs.weight"].tolist())  # all three regimes: 1, 8, between
    assert {1.0, 8.0} < factors and all(1.0 <= f <= 8.0 for f in factors)
    assert "llama.rope.scaling.type" not in llama3
    with pytest.raises(ValueError, match="rope scaling 'dynamic' of a llama model has no "
                                         "GGUF form here"):
        written("dynamic", {"rope_type": "dynamic", "factor": 2.0})


def test_refuses_what_it_cannot_write(tmp_path):
    model = tf.Olmo2ForCausalLM(tf.Olmo2Config(vocab_size=len(VOCAB), hidden_size=32,
                                               intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4))
    model.save_pretrained(tmp_path / "olmo2")
    bpe_tokenizer().save_pretrained(tmp_path / "olmo2")
    with pytest.raises(ValueError, match="cannot write a 'olmo2' checkpoint as GGUF: "
                                         "supported architectures are llama, mistral"):
        write_gguf(tmp_path / "olmo2", tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="quant must be one of"):
        write_gguf(tmp_path / "olmo2", tmp_path / "x.gguf", quant="q5_k")
    # llama.cpp scales Gemma's queries by the head size, not by query_pre_attn_scalar
    gemma = tf.Gemma2Config(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, query_pre_attn_scalar=12)
    tf.Gemma2ForCausalLM(gemma).save_pretrained(tmp_path / "gemma2")
    bpe_tokenizer().save_pretrained(tmp_path / "gemma2")
    with pytest.raises(ValueError, match=r"by 1/sqrt\(12\) with a head_dim of 8"):
        write_gguf(tmp_path / "gemma2", tmp_path / "x.gguf")
    # the tiny models' character tokenizer is a WordLevel, not a byte-level BPE
    tiny_model("llama").save_pretrained(tmp_path / "chars")
    char_tokenizer().save_pretrained(tmp_path / "chars")
    with pytest.raises(ValueError, match="is not a byte-level BPE"):
        write_gguf(tmp_path / "chars", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".x.gguf.*"))
