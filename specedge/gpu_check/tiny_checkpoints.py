"""Tiny random-weight checkpoints (seconds to build and export) with a character tokenizer:
Llama, Qwen2, Mistral and GPT-2 models whose next-token distributions are peaked like a
trained model's. The GPU check exports the Llama one as its tiny bundle
(backends.py); the tests build theirs here too. Needs torch and transformers (the
export extra)."""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SPECIALS = ["<unk>", "<s>", "</s>"]
CHARS = string.ascii_lowercase + " .,!?"
VOCAB = SPECIALS + list(CHARS)
BOS, EOS = 1, 2
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt2")


def char_tokenizer(other_ids: bool = False) -> PreTrainedTokenizerFast:
    """One token per character; `other_ids` reverses the character ids (same size)."""
    chars = list(CHARS)[::-1] if other_ids else list(CHARS)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(arch: str, vocab_size: int = len(VOCAB), layers: int = 2, seed: int = 0,
               max_positions: int = 512, hidden_size: int = 32):
    """hidden_size 32: head size 8 (Llama family: 4 heads, 2 KV heads); 64 gives head size
    16, the smallest ONNX Runtime's GroupQueryAttention takes."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, bos_token_id=BOS, eos_token_id=EOS)
    # A wide init makes the next-token distributions peaked, like a trained model's.
    if arch == "gpt2":
        cfg = GPT2Config(n_positions=max_positions, n_embd=32, n_layer=layers, n_head=4,
                         initializer_range=0.3, **common)
        return _rare_eos(GPT2LMHeadModel(cfg).eval())
    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    cfg = cls[0](hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=max_positions, initializer_range=0.3,
                 tie_word_embeddings=False, **common)
    return _rare_eos(cls[1](cfg).eval())


def _rare_eos(model):
    """Shrink EOS's output row so that generations run long but can still end."""
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS] *= 0.2
    return model


def save_tiny(path: Path, arch: str = "llama", layers: int = 2, seed: int = 0,
              other_ids: bool = False, vocab_size: int = len(VOCAB),
              hidden_size: int = 32) -> Path:
    """Write a tiny checkpoint folder (model + tokenizer + chat template) and return it."""
    model = tiny_model(arch, vocab_size=vocab_size, layers=layers, seed=seed,
                       hidden_size=hidden_size)
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(path)
    char_tokenizer(other_ids).save_pretrained(path)
    return path
