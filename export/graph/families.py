"""Which architectures export, the sizes their graphs are built with, and which attention
each gets."""

from __future__ import annotations

from torch import nn

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
GPT2_FAMILY = ("gpt2",)
GEMMA_FAMILY = ("gemma2", "gemma3_text")
# One file each in this package (phi3.py, granite.py, olmo2.py, stablelm.py).
MORE_FAMILIES = ("phi3", "granite", "olmo2", "stablelm")
# Whose fused graphs can let GroupQueryAttention rotate q and k (`kernel_rotates`); the
# others rotate in the graph (Gemma: tables per layer kind, which the kernel cannot take)
# or have no rotary (GPT-2).
KERNEL_ROTARY_FAMILIES = LLAMA_FAMILY + MORE_FAMILIES


# Targets whose decoder layer a feature draft (export/drafts/feature.py) takes as its own:
# every family, each export module's layer hooks being the layer's own (graph/decoder.py).
FEATURE_DRAFT_FAMILIES = LLAMA_FAMILY + MORE_FAMILIES + GEMMA_FAMILY + GPT2_FAMILY


SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + GPT2_FAMILY + MORE_FAMILIES + GEMMA_FAMILY
ATTENTIONS = ("auto", "fused", "batched", "portable")  # `specedge export --attention`


def attention_form(attention: str, precision: str, config) -> str:
    """The attention form a graph gets, for a Hugging Face `config` (graph/attention.py):
    "portable", "fused" (GroupQueryAttention, KV layout "bhsd-inplace") or "batched"
    (ONNX's Attention, in place too). `auto` picks batched where ONNX Runtime CPU is the
    only runtime for the graph anyway (int8 and int4: TensorRT cannot parse MatMulNBits):
    it computes a row alike in every call of two tokens or more, alone or beside other
    rows, on x86 and aarch64, which keeps int8/int4 greedy speculative output equal to
    plain decoding, one sequence or several (docs/design.md, "Batch invariance of quantized
    graphs"); its one-sequence step runs as fast as fused's (docs/export.md, "Attention").
    Fused needs a head size that is a multiple of 8 (the CPU kernel); it rotates q and k
    itself where `kernel_rotates`, and the graph rotates them before it otherwise."""
    if attention not in ATTENTIONS:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTIONS)}, "
                         f"got {attention!r}")
    head = model_dims_of(config)["head_dim"]
    if attention == "fused" and head % 8:
        raise ValueError(f"--attention fused needs a head size that is a multiple of 8 "
                         f"(ONNX Runtime's GroupQueryAttention), not {head} "
                         f"({config.model_type!r}): export it with --attention portable")
    if attention in ("fused", "batched"):
        return attention
    return "batched" if attention == "auto" and precision in ("int8", "int4") else "portable"


def kernel_rotates(config) -> bool:
    """Whether a fused graph lets GroupQueryAttention rotate q and k: a family of
    `KERNEL_ROTARY_FAMILIES` whose head size and rotary size (partial rotary: Phi-3,
    StableLM) are multiples of 16, the kernel's requirement."""
    head = model_dims_of(config)["head_dim"]
    rotary = int(head * (getattr(config, "rope_parameters", None) or {}).get(
        "partial_rotary_factor", 1.0))
    return config.model_type in KERNEL_ROTARY_FAMILIES and head % 16 == 0 and rotary % 16 == 0


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
    # Sliding-window layers mask attention to their window (graph/attention.py), so the
    # context is the model's full one.
    max_context = cfg.max_position_embeddings
    if cfg.model_type == "phi3":
        max_context = phi3_context(cfg)
    return {"num_layers": cfg.num_hidden_layers, "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim, "vocab_size": cfg.vocab_size, "max_context": max_context}


def phi3_context(cfg) -> int:
    """The largest context a Phi-3 bundle is exact for: under LongRoPE
    `original_max_position_embeddings`, else the model's. transformers rotates a Phi-3
    sequence with the short factors while it is at most that long, and once it grows past
    it, generation recomputes the whole cache with the long factors
    (Phi3ForCausalLM.prepare_inputs_for_generation); a bundle's cache is never recomputed."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        return min(cfg.max_position_embeddings, int(rope["original_max_position_embeddings"]))
    return cfg.max_position_embeddings


def layer_windows(cfg) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), as transformers masks
    them: Mistral slides in every layer when its config has a window; Qwen2 and Qwen3 in
    the layers their `layer_types` call "sliding_attention" (their configs drop the window
    unless `use_sliding_window`)."""
    window = getattr(cfg, "sliding_window", None)
    n = cfg.num_hidden_layers
    if not window:
        return [None] * n
    types = getattr(cfg, "layer_types", None) if cfg.model_type != "mistral" else None
    if types is None:
        return [window] * n
    return [window if kind == "sliding_attention" else None for kind in types[:n]]
