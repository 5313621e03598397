"""Tiny random-weight checkpoints (seconds to build and export) with a character tokenizer:
the package's (specedge/gpu_check/tiny_checkpoints.py: Llama, Qwen2, Mistral, GPT-2), and the Gemma,
Phi-3, Granite, OLMo2 and StableLM ones and the slow Llama that only the tests use."""

from __future__ import annotations

from pathlib import Path

import torch

from specedge.gpu_check.tiny_checkpoints import (  # noqa: F401  (the tests import them from here)
    ARCHITECTURES,
    BOS,
    CHAT_TEMPLATE,
    EOS,
    SPECIALS,
    VOCAB,
    _rare_eos,
    char_tokenizer,
    save_tiny,
    tiny_model,
)

GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")
GEMMA_WINDOW = 8  # sliding window of the tiny Gemma models: shorter than the test prompts


def tiny_gemma(arch: str, layers: int = 4, seed: int = 0, max_positions: int = 512):
    """A tiny Gemma 2 or Gemma 3 text model with every feature the export must honour on:
    sliding layers (window GEMMA_WINDOW) alternating with global ones, attention soft-capping
    (Gemma 2) and final soft-capping small enough to bite, a query_pre_attn_scalar other
    than the head size, tied embeddings; Gemma 3 also its q/k norms, a local rope base and
    linear rope scaling on the global layers (given as a checkpoint's legacy keys)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    common = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=max_positions, initializer_range=0.1,
                  query_pre_attn_scalar=12, sliding_window=GEMMA_WINDOW,
                  final_logit_softcapping=4.0, tie_word_embeddings=True, bos_token_id=BOS,
                  eos_token_id=EOS, pad_token_id=0)
    if arch == "gemma2":
        cfg = Gemma2Config(attn_logit_softcapping=2.0, **common)
        model = Gemma2ForCausalLM(cfg)
    else:
        cfg = Gemma3TextConfig(sliding_window_pattern=2, rope_theta=1e5,
                               rope_local_base_freq=100.0,
                               rope_scaling={"rope_type": "linear", "factor": 4.0}, **common)
        model = Gemma3ForCausalLM(cfg)
    # The (1 + w) norms start at w = 0. Random weights, and post norms that double the
    # layers' outputs against the scaled embedding: with tied embeddings the residual
    # stream would otherwise be the input token's row, and greedy text one repeated token.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(2.0 if ".post_" in name else 0.0, 0.3)
    return _rare_eos(model.eval())


def save_tiny_gemma(path: Path, arch: str, layers: int = 4, seed: int = 0) -> Path:
    """`save_tiny` for `tiny_gemma`."""
    model = tiny_gemma(arch, layers=layers, seed=seed)
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


MORE_ARCHITECTURES = ("phi3", "granite", "olmo2", "stablelm")
LONGROPE_ORIGINAL = 128  # Phi-3's original_max_position_embeddings: its bundle's context
PHI3_WINDOW = 16  # Phi-3's sliding window: shorter than the test prompts


def tiny_more(arch: str, layers: int = 2, seed: int = 0, hidden_size: int = 64,
              parallel: bool = True):
    """A tiny Phi-3, Granite, OLMo2 or StableLM model with each family's distinguishing
    features on. Phi-3: LongRoPE with distinct short and long factors, partial rotary 0.75
    (Phi-4-mini's), a sliding window, tied embeddings. Granite: embedding, residual and
    attention multipliers and logits scaling other than 1, attention and MLP biases, tied
    embeddings. OLMo2: its
    post-norms and q/k norms with weights other than 1. StableLM: partial rotary 0.25,
    q/k/v biases, per-head q/k LayerNorms, LayerNorms with weights and biases other than 1
    and 0, parallel residual (or not: `parallel`). hidden_size 64: head size 16 (Phi-3 and
    StableLM: two heads of 64), what GroupQueryAttention takes."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=len(VOCAB), hidden_size=hidden_size, intermediate_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.3,
                  tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS,
                  pad_token_id=0)
    if arch in ("phi3", "granite"):  # Phi-4-mini and Granite 3.x tie their embeddings
        common["tie_word_embeddings"] = True
    if arch in ("phi3", "stablelm"):
        # Two heads of hidden_size: ONNX Runtime's kernel rotates a multiple of 16 dims, so
        # fused graphs with partial rotary (0.75 and 0.25 of a head) need heads of 64.
        common.update(hidden_size=2 * hidden_size, num_attention_heads=2,
                      num_key_value_heads=1)
    if arch == "phi3":
        half = int(hidden_size * 0.75) // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.3 * i for i in range(half)],
                "long_factor": [4.0 + 2.0 * i for i in range(half)],
                "original_max_position_embeddings": LONGROPE_ORIGINAL}
        cfg = tf.Phi3Config(rope_parameters=rope, partial_rotary_factor=0.75,
                            original_max_position_embeddings=LONGROPE_ORIGINAL,
                            sliding_window=PHI3_WINDOW, **common)
        model = tf.Phi3ForCausalLM(cfg)
    elif arch == "granite":
        cfg = tf.GraniteConfig(embedding_multiplier=3.0, residual_multiplier=0.4,
                               attention_multiplier=0.2, logits_scaling=0.5,
                               attention_bias=True, mlp_bias=True, **common)
        model = tf.GraniteForCausalLM(cfg)
    elif arch == "olmo2":
        model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**common))
    else:
        cfg = tf.StableLmConfig(partial_rotary_factor=0.25, use_qkv_bias=True,
                                qk_layernorm=True, use_parallel_residual=parallel, **common)
        model = tf.StableLmForCausalLM(cfg)
    with torch.no_grad():  # norms start at weight 1 (and bias 0): give them values to apply
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
            elif name.endswith("bias"):  # projection biases start at 0
                p.normal_(0.0, 0.3)
    return _rare_eos(model.eval())


def save_tiny_more(path: Path, arch: str, layers: int = 2, seed: int = 0,
                   hidden_size: int = 64, parallel: bool = True) -> Path:
    """`save_tiny` for `tiny_more`."""
    model = tiny_more(arch, layers=layers, seed=seed, hidden_size=hidden_size,
                      parallel=parallel)
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def export_slow_bundle(root: Path, context: int, attention: str = "auto") -> Path:
    """A random Llama wide enough to take a few ms a token on one thread, also on a CPU with
    AVX-512 (4 layers, hidden 256, MLP 4096, `context` positions) with the character
    tokenizer, exported with its first layer as the draft into root/bundle. Its EOS row is
    zeroed so that greedy runs reach max_tokens: the server tests drop, queue, time out and
    kill requests while it runs. `attention`: as `specedge export --attention`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specedge.export.bundle_writer import export_bundle

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=4096, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=context, initializer_range=0.3,
                      tie_word_embeddings=False, vocab_size=len(VOCAB), bos_token_id=BOS,
                      eos_token_id=EOS)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS] = 0.0
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(root / "checkpoint")
    char_tokenizer().save_pretrained(root / "checkpoint")
    export_bundle(str(root / "checkpoint"), root / "bundle", draft_layers=1, attention=attention)
    return root / "bundle"
