"""The config a GGUF file means, where transformers' GGUF reader takes less of it.

transformers rebuilds a config from the GGUF keys it maps (`GGUF_CONFIG_MAPPING`) and leaves
everything else at the config class's default, so a file that uses rope scaling, partial
rotary, a sliding window, soft-capping, ... loads as another model, and `--verify` cannot
see it (it compares with that same model). `complete_config` sets those values from the
llama.cpp keys and tensors, read as llama.cpp reads them (its defaults where a key is
absent), and refuses what has no exact config form here. `extra_weights` gives the weights
transformers does not map (StableLM's per-head q/k norms).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

# Tensors read here, not by transformers: small, f32 in the files llama.cpp writes.
_READ_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp's YaRN keys that transformers' yarn has no parameter for.
_YARN_EXTRAS = ("attn_factor", "yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier")
# Layer counts that llama.cpp takes for the 27B models, which scale queries by
# 1/sqrt(hidden / heads) instead of 1/sqrt(head size).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

REFUSAL = "export the model from its Hugging Face checkpoint (folder or Hub id) instead"


def read_gguf_metadata(path: Path) -> tuple[dict, dict[str, np.ndarray], set[str]]:
    """(keys, small tensors, tensor names) of a GGUF file: every key but the tokenizer's, as
    Python values; the rope tensors as float arrays."""
    import gguf

    reader = gguf.GGUFReader(path)
    keys = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or key.startswith("GGUF."):
            continue
        kinds = field.types
        values = [bytes(field.parts[i]).decode() if kinds[-1] == gguf.GGUFValueType.STRING
                  else field.parts[i].tolist()[0] for i in field.data]
        keys[key] = values if kinds[0] == gguf.GGUFValueType.ARRAY else values[0]
    names = {t.name for t in reader.tensors}
    small = {t.name: gguf.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
             for t in reader.tensors if t.name in _READ_TENSORS}
    return keys, small, names


def complete_config(config: dict, keys: dict, tensors: dict[str, np.ndarray],
                    names: set[str]) -> dict:
    """`config` (transformers' config of the file, as a dict) with what the file's `keys`
    and rope `tensors` say and transformers' reader drops. ValueError for a file whose model
    has no exact config form here."""
    arch = keys["general.architecture"]

    def key(name: str, default=None):
        return keys.get(f"{arch}.{name}", default)

    def refuse(what: str):
        raise ValueError(f"this GGUF file ({arch}) uses {what}, which cannot be rebuilt "
                         f"exactly from the file: {REFUSAL}")

    config = dict(config)
    if arch == "gpt2":
        config["n_positions"] = key("context_length", config.get("n_positions"))
        config["n_inner"] = key("feed_forward_length", config.get("n_inner"))
        return config
    rope = _rope_parameters(config, key, tensors, arch, refuse)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if arch == "qwen3" and key("attention.key_length"):
        config["head_dim"] = key("attention.key_length")
    if arch in ("phi3", "stablelm"):
        # llama.cpp rotates rope.dimension_count dims of each head (Phi-3 writes
        # partial * hidden / heads, StableLM partial * head size: the same thing).
        rope["partial_rotary_factor"] = key("rope.dimension_count", head_dim) / head_dim
    if arch == "phi3":
        config["sliding_window"] = key("attention.sliding_window") or None
        original = key("rope.scaling.original_context_length")
        if original:
            config["original_max_position_embeddings"] = original
    if arch == "stablelm":
        config["qk_layernorm"] = "blk.0.attn_q_norm.weight" in names
    if arch in ("gemma2", "gemma3"):
        _gemma(config, key, arch, heads, head_dim, rope)
    config["rope_parameters"] = rope
    return config


def _rope_parameters(config: dict, key, tensors: dict, arch: str, refuse) -> dict:
    """The rope parameters with the file's base and scaling (`key` reads the file's keys of
    its architecture, `refuse` raises). For Gemma 3, the per layer type dict, the scaling on
    the full-attention layers (llama.cpp scales no sliding layer)."""
    rope = {k: dict(v) if isinstance(v, dict) else v
            for k, v in (config.get("rope_parameters") or {}).items()}
    full = rope.setdefault("full_attention", {}) if arch == "gemma3" else rope
    if key("rope.freq_base") is not None:
        full["rope_theta"] = float(key("rope.freq_base"))
    if arch == "gemma3":
        # llama.cpp's local base when the file names none
        rope.setdefault("sliding_attention", {"rope_type": "default"})
        rope["sliding_attention"]["rope_theta"] = float(key("rope.freq_base_swa", 10000.0))
    kind = key("rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        fitted = llama3_rope(full.get("rope_theta", 10000.0), tensors["rope_freqs.weight"])
        if arch != "llama" or kind != "none" or fitted is None:
            refuse("a rope_freqs tensor that is not Llama 3 rope scaling")
        if fitted:
            full.update(rope_type="llama3", **fitted)
    elif "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        if (arch != "phi3" or kind not in ("none", "longrope")
                or not {"rope_factors_long.weight", "rope_factors_short.weight"} <= set(tensors)):
            refuse("rope factor tensors other than Phi-3's LongRoPE pair")
        original = key("rope.scaling.original_context_length")
        if not original:
            refuse("LongRoPE without rope.scaling.original_context_length")
        full.update(rope_type="longrope", original_max_position_embeddings=int(original),
                    long_factor=tensors["rope_factors_long.weight"].tolist(),
                    short_factor=tensors["rope_factors_short.weight"].tolist())
        scale = config["max_position_embeddings"] / original
        # llama.cpp's attention factor, which transformers computes from the two contexts
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        full["attention_factor"] = float(key("rope.scaling.attn_factor", default))
    elif kind == "linear":
        full.update(rope_type="linear", factor=float(key("rope.scaling.factor")))
    elif kind == "yarn":
        extras = [k for k in _YARN_EXTRAS if key(f"rope.scaling.{k}") is not None]
        if extras:
            refuse(f"YaRN with {', '.join(extras)}")
        full.update(rope_type="yarn", factor=float(key("rope.scaling.factor")),
                    original_max_position_embeddings=int(
                        key("rope.scaling.original_context_length")))
        for name in ("beta_fast", "beta_slow"):
            if key(f"rope.scaling.yarn_{name}") is not None:
                full[name] = float(key(f"rope.scaling.yarn_{name}"))
    elif kind != "none":
        refuse(f"rope scaling {kind!r}")
    return rope


def llama3_rope(theta: float, divisors: np.ndarray) -> dict | None:
    """Llama 3 rope parameters whose frequencies are exactly llama.cpp's: the base ones
    divided by `divisors` (its rope_freqs tensor); {} when they divide by 1; None when no
    Llama 3 scaling gives them.

    Llama 3's divisor is 1 for short wavelengths, `factor` for long ones, and between them
    1 / g with g = (1 - s) / factor + s, where s = (old / wavelength - low) / (high - low)
    is linear in 1 / wavelength: only old / (high - low) and low / (high - low) matter, so
    low is taken as 1 and the other two are solved from the file; parameters that put no
    frequency between the two regimes are chosen between them. The result is checked
    against the file whatever the way it was found."""
    divisors = np.asarray(divisors, dtype=np.float64)
    dim = 2 * len(divisors)
    base = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    x = base / (2 * math.pi)  # 1 / wavelength
    factor = float(divisors.max())
    if np.allclose(divisors, 1.0, rtol=1e-6):
        return {}
    ones = np.isclose(divisors, 1.0, rtol=1e-6)
    longs = np.isclose(divisors, factor, rtol=1e-6)
    between = ~ones & ~longs
    s = (1 / divisors - 1 / factor) / (1 - 1 / factor)
    if between.sum() >= 2:
        i, j = np.flatnonzero(between)[[0, -1]]
        a = (s[i] - s[j]) / (x[i] - x[j])  # s = a x - b, a = old / (high - 1), b = 1 / (high - 1)
        b = a * x[i] - s[i]
        if a <= 0 or b <= 0:
            return None
        high, old = 1 + 1 / b, a / b
    elif between.sum() == 1:
        i = int(np.flatnonzero(between)[0])
        high, old = 4.0, (3 * s[i] + 1) / x[i]
    else:  # old between 4 / x of the shortest-wave ones and 1 / x of the longest-wave others
        lo = 4 / x[ones].min() if ones.any() else 0.0
        hi = 1 / x[longs].max()
        old = math.sqrt(lo * hi) if lo else hi / 2
        high = 4.0
    params = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": float(high),
              "original_max_position_embeddings": int(round(old))}
    return params if np.allclose(_llama3_divisors(base, params), divisors, rtol=1e-5) else None


def _llama3_divisors(base: np.ndarray, p: dict) -> np.ndarray:
    """What transformers' llama3 rope divides `base` by."""
    wavelength = 2 * math.pi / base
    old, low, high = (p["original_max_position_embeddings"], p["low_freq_factor"],
                      p["high_freq_factor"])
    s = np.clip((old / wavelength - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - s) / p["factor"] + s)


def _gemma(config: dict, key, arch: str, heads: int, head_dim: int, rope: dict) -> None:
    """Soft-capping (llama.cpp's Gemma 2 defaults are the config's), the query scale as
    llama.cpp picks it, and Gemma 3's sliding layers."""
    if key("attn_logit_softcapping") is not None:
        config["attn_logit_softcapping"] = key("attn_logit_softcapping")
    if key("final_logit_softcapping") is not None:
        config["final_logit_softcapping"] = key("final_logit_softcapping")
    layers = config["num_hidden_layers"]
    config["query_pre_attn_scalar"] = (config["hidden_size"] // heads
                                       if layers == _GEMMA_27B_LAYERS[arch] else head_dim)
    if arch == "gemma3":
        window = key("attention.sliding_window") or 0
        pattern = key("attention.sliding_window_pattern")
        if not window:  # llama.cpp: no window, no sliding layer
            sliding = [False] * layers
        elif isinstance(pattern, list):
            sliding = [bool(s) for s in pattern]
        else:  # llama.cpp's period: every sixth layer global, or the file's period
            period = pattern or 6
            sliding = [i % period < period - 1 for i in range(layers)]
        config["sliding_window"] = window or None
        config["layer_types"] = ["sliding_attention" if s else "full_attention"
                                 for s in sliding]


def extra_weights(config: dict, path: Path) -> dict:
    """State-dict entries that transformers does not read from the file: StableLM's q/k
    LayerNorms, which llama.cpp stacks per layer into one (heads, head size) tensor."""
    import gguf
    import torch

    if config.get("model_type") != "stablelm" or not config.get("qk_layernorm"):
        return {}
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[2] in ("attn_q_norm", "attn_k_norm"):
            # numpy order: (heads, head size); the reader's shape is ggml's, head size first
            stacked = gguf.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))
            which = "q" if parts[2] == "attn_q_norm" else "k"
            for h, row in enumerate(np.asarray(stacked, dtype=np.float32)):
                out[f"model.layers.{parts[1]}.self_attn.{which}_layernorm.norms.{h}.weight"] = \
                    torch.from_numpy(row.copy())
    return out
