"""Which architectures export, the sizes their graphs are built with, and which attention
each gets."""

from __future__ import annotations

from torch import nn

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
GPT2_FAMILY = ("gpt2",)


SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + GPT2_FAMILY
ATTENTIONS = ("auto", "fused", "portable")  # `specedge export --attention`


def fused_attention(attention: str, precision: str, config) -> bool:
    """Whether a graph gets GroupQueryAttention (KV layout "bhsd-inplace"), for a Hugging
    Face `config`. `auto` picks it where ONNX Runtime CPU is the only runtime for the graph
    anyway (int8 and int4: TensorRT cannot parse MatMulNBits) and the model can have it:
    Llama family, head size a multiple of 16 (the CPU kernel's requirement)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTIONS)}, "
                         f"got {attention!r}")
    can = config.model_type in LLAMA_FAMILY and model_dims_of(config)["head_dim"] % 16 == 0
    if attention == "fused" and not can:
        raise ValueError(f"--attention fused needs a Llama, Mistral or Qwen2 model with a "
                         f"head size that is a multiple of 16, not {config.model_type!r} "
                         f"with {model_dims_of(config)['head_dim']}: export it with "
                         "--attention portable")
    return attention == "fused" or (attention == "auto" and can
                                    and precision in ("int8", "int4"))


def model_dims(model: nn.Module) -> dict[str, int]:
    """Layer count, KV heads, head dim, vocab size and largest usable context of a model."""
    return model_dims_of(model.config)


def model_dims_of(cfg) -> dict[str, int]:
    """`model_dims` from a Hugging Face config."""
    if cfg.model_type in GPT2_FAMILY:
        return {"num_layers": cfg.n_layer, "num_kv_heads": cfg.n_head,
                "head_dim": cfg.n_embd // cfg.n_head, "vocab_size": cfg.vocab_size,
                "max_context": cfg.n_positions}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    max_context = cfg.max_position_embeddings
    # Sliding-window attention only differs from full attention beyond the window; the graph
    # does full attention, so the context is capped at the window to stay exact.
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        max_context = min(max_context, cfg.sliding_window)
    return {"num_layers": cfg.num_hidden_layers, "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim, "vocab_size": cfg.vocab_size, "max_context": max_context}
