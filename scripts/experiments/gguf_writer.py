"""Write a Hugging Face checkpoint folder as a GGUF file, laid out as llama.cpp's
convert_hf_to_gguf.py lays it out, so that llama.cpp runs the very weights a bundle runs
(random-weight benchmark models have no GGUF of their own) and transformers reads the file
back. Its other direction is `gguf_config.py`: the config a GGUF file's keys mean, when such
a file is exported.

What follows llama.cpp's conventions, per architecture:

- llama, mistral: written as llama.cpp's `llama` architecture (Mistral has none of its own),
  with the q and k projections permuted from Hugging Face's rotate-half order to llama.cpp's
  interleaved one; transformers un-permutes them on load for a `llama` file, and reads a
  Mistral file back as a Llama model (the same computation without a sliding window; a file
  whose general.name is exactly "mistral" it would take for Mistral, but gguf 0.19 has no
  such architecture and transformers 5.24 then fails to map its tensors). Llama 3 rope
  scaling becomes the `rope_freqs` tensor, linear scaling the `rope.scaling.*` keys.
- gemma2, gemma3_text: the (1 + w) norms are stored as 1 + w (llama.cpp adds 1, transformers
  subtracts it again); no output tensor (the embeddings are tied). llama.cpp scales queries
  by 1/sqrt(head_dim), so a checkpoint whose query_pre_attn_scalar differs is refused.
- gpt2: the Conv1D weights are transposed to (out, in), and the tied head is written out as
  `output.weight`, a copy of the embedding table, as llama.cpp writes it.
- phi3: fused qkv and gate_up weights as they are; LongRoPE factors as the `rope_factors_*`
  tensors.
- stablelm: per-head q/k LayerNorms stacked into one (heads, head size) tensor.
- qwen2, qwen3: names only.

The tokenizer must be a byte-level BPE (GPT-2's scheme: Llama 3, Qwen, SmolLM, GPT-2, Phi-4):
it is written as `tokenizer.ggml.model = "gpt2"` with its tokens, token types and merges.
SentencePiece vocabularies (Llama 2, Gemma) would need llama.cpp's `llama` tokenizer with
scores, which this does not write.

Tensors are read from the safetensors files one at a time and written at once, so a
checkpoint of about a billion parameters is never held twice in memory.

Checked by hand against llama.cpp (llama-cpp-python 0.3.36), not in the tests (llama.cpp is
not a dependency): a tiny model of each architecture gives the original model's logits to
6e-5 with an f32 KV cache (GPT-2 and Gemma to 2e-3: llama.cpp's GELU approximation), and
SmolLM2-135M written at q4_1 gives tensors byte for byte those of llama.cpp's own Q4_1 file
of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specedge.runtime.atomic_files import replacing

# model_type -> llama.cpp architecture name (gguf.MODEL_ARCH_NAMES), for the families that
# specedge exports and transformers reads back from GGUF. Granite and OLMo2 are left out:
# llama.cpp has them, transformers cannot load them from GGUF.
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3",
                      "stablelm": "stablelm", "gpt2": "gpt2"}
QUANTS = ("f32", "f16", "q8_0", "q4_0", "q4_1")
BLOCK = 32  # elements per block of Q8_0, Q4_0 and Q4_1: rows must be a multiple of it


@dataclass
class _Tensor:
    """One tensor of the file: its GGUF name, its shape (numpy order), and how to read it."""

    name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]


def write_gguf(checkpoint: Path, out: Path, quant: str = "f32") -> Path:
    """Write the checkpoint folder `checkpoint` (config.json, safetensors, tokenizer.json) as
    the GGUF file `out`, its 2-D weights stored as `quant` (f32, f16, q8_0, q4_0, q4_1; rows
    whose length is not a multiple of 32 stay f32, norms and biases are always f32, and a
    4-bit file keeps its output tensor at q8_0). Returns `out`."""
    import gguf
    from transformers import AutoConfig

    checkpoint, out = Path(checkpoint), Path(out)
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    cfg = AutoConfig.from_pretrained(checkpoint)
    if cfg.model_type not in GGUF_ARCHITECTURES:
        raise ValueError(f"cannot write a {cfg.model_type!r} checkpoint as GGUF: supported "
                         f"architectures are {', '.join(GGUF_ARCHITECTURES)}")
    arch = GGUF_ARCHITECTURES[cfg.model_type]
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
             "q4_1": gguf.GGMLQuantizationType.Q4_1}[quant]
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                 "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[quant]

    tensors = list(_tensors(checkpoint, cfg, arch))
    has_output = any(t.name == "output.weight" for t in tensors)
    kinds = {t.name: _storage(t, qtype, gguf, has_output) for t in tensors}
    with replacing(out) as tmp:  # never a half-written file at `out`
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            # No general.name: transformers reads a `llama` file named exactly "mistral" as
            # Mistral (see above), and nothing else needs it.
            _hyperparameters(writer, cfg, arch)
            writer.add_file_type(file_type)
            if quant not in ("f32", "f16"):
                writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            _tokenizer(writer, checkpoint, cfg)
            # The tensor table goes before the data, so it is planned from the shapes alone;
            # the data then follows one tensor at a time.
            for t in tensors:
                _add_info(writer, t, kinds[t.name], gguf)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for t in tensors:
                writer.write_tensor_data(_encode(t, kinds[t.name], gguf))
        finally:
            writer.close()
    return out


def _add_info(writer, t: _Tensor, kind, gguf) -> None:
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        dtype = np.dtype(np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16)
        writer.add_tensor_info(t.name, t.shape, dtype, math.prod(t.shape) * dtype.itemsize)
    else:
        nbytes = math.prod(gguf.quants.quant_shape_to_byte_shape(t.shape, kind))
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes, raw_dtype=kind)


def _encode(t: _Tensor, kind, gguf) -> np.ndarray:
    """The tensor's bytes as stored: f32, f16, or quantized blocks."""
    data = np.ascontiguousarray(t.load(), dtype=np.float32)
    if data.shape != t.shape:
        raise AssertionError(f"{t.name}: planned as {t.shape}, read as {data.shape}")
    if kind == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    if kind != gguf.GGMLQuantizationType.F32:
        return gguf.quants.quantize(data, kind)
    return data


def _storage(t: _Tensor, qtype, gguf, has_output: bool):
    """The GGML type a tensor is stored as, by llama.cpp's rules: 1-D tensors, norms, rope
    factors and learned positions in f32; at 4 bits the output tensor (the embedding table
    when the head is tied to it) in q8_0, as llama-quantize keeps it at 8 bits or more (it
    picks q6_K where rows are a multiple of 256, which gguf cannot write); the other weights
    in `qtype` where their rows divide into blocks (else f32, exact)."""
    f32, q8 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
    if (len(t.shape) < 2 or t.name.endswith("_norm.weight") or t.name.startswith("rope_")
            or t.name.startswith("position_embd")):
        return f32
    if qtype in (f32, gguf.GGMLQuantizationType.F16):
        return qtype
    if t.shape[-1] % BLOCK:
        return f32
    head = t.name == "output.weight" or (t.name == "token_embd.weight" and not has_output)
    if head and qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        return q8
    return qtype


def _rope(cfg) -> dict:
    """The rope parameters of the full-attention layers (transformers 5 nests them per layer
    type for Gemma 3)."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if "full_attention" in rope:
        rope = dict(rope["full_attention"])
    return rope


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _hyperparameters(writer, cfg, arch: str) -> None:
    """The architecture keys llama.cpp reads (and transformers maps back to a config)."""
    if arch == "gpt2":
        writer.add_context_length(cfg.n_positions)
        writer.add_embedding_length(cfg.n_embd)
        writer.add_block_count(cfg.n_layer)
        writer.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        writer.add_head_count(cfg.n_head)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
        return
    rope = _rope(cfg)
    head_dim = _head_dim(cfg)
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(getattr(cfg, "num_key_value_heads", None)
                             or cfg.num_attention_heads)
    if "rope_theta" in rope:
        writer.add_rope_freq_base(float(rope["rope_theta"]))
    if arch == "stablelm":
        writer.add_layer_norm_eps(cfg.layer_norm_eps)
        writer.add_parallel_residual(bool(cfg.use_parallel_residual))
        writer.add_rope_dimension_count(int(partial * head_dim))
        return
    if arch in ("gemma2", "gemma3") and cfg.query_pre_attn_scalar != head_dim:
        raise ValueError(f"llama.cpp scales Gemma's queries by 1/sqrt(head_dim) (but for its "
                         f"27B models), and this checkpoint by "
                         f"1/sqrt({cfg.query_pre_attn_scalar}) with a head_dim of {head_dim}: "
                         "llama.cpp would compute another model; give a checkpoint whose "
                         "query_pre_attn_scalar is its head_dim")
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("llama", "qwen2", "qwen3", "gemma3"):
        _rope_scaling(writer, rope, arch)
    if arch == "llama":
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    elif arch == "phi3":
        writer.add_rope_dimension_count(int(partial * cfg.hidden_size) // cfg.num_attention_heads)
        original = int(rope.get("original_max_position_embeddings")
                       or getattr(cfg, "original_max_position_embeddings", None)
                       or cfg.max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(original)
        # llama.cpp tells Phi-4 (no window) from Phi-3 by a window of 0.
        writer.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    elif arch == "gemma2":
        if cfg.attn_logit_softcapping is not None:
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if cfg.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    elif arch == "gemma3":
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        local = (cfg.rope_parameters or {}).get("sliding_attention", {}).get("rope_theta")
        if local is not None:
            writer.add_rope_freq_base_swa(float(local))


def _rope_scaling(writer, rope: dict, arch: str) -> None:
    """Linear and YaRN scaling as `rope.scaling.*` keys. Llama 3's goes into the
    `rope_freqs` tensor instead (`_rope_tensors`); any other would leave llama.cpp computing
    another model than the checkpoint's, so it is refused."""
    import gguf

    kind = rope.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind not in ("default", "llama3") or kind == "llama3" and arch != "llama":
        raise ValueError(f"rope scaling {kind!r} of a {arch} model has no GGUF form here: "
                         "give a checkpoint without it, or one with linear, yarn or (Llama) "
                         "llama3 scaling")


def _safetensors_files(checkpoint: Path) -> list[Path]:
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [checkpoint / n for n in names]
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{checkpoint} has no safetensors weights: save the model with "
                         "save_pretrained (safetensors) first")
    return files


def _reader(path: Path, name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name).float().numpy()
    return load


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's rotate-half q/k rows into llama.cpp's interleaved pairs, per head
    (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tensors(checkpoint: Path, cfg, arch: str) -> Iterator[_Tensor]:
    """Every tensor of the file in order, read lazily."""
    import gguf
    from safetensors import safe_open

    layers = cfg.n_layer if arch == "gpt2" else cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in _safetensors_files(checkpoint):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                found[key] = (path, tuple(f.get_slice(key).get_shape()))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    stacked: dict[str, list[str]] = {}  # StableLM: GGUF name -> per-head norm tensors
    unknown = []
    embedding = None
    for key, (path, shape) in found.items():
        load = _reader(path, key)
        if arch == "gpt2" and key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers of old checkpoints, not weights
        if key == "lm_head.weight" and tied:
            continue  # the head is the embedding table
        if arch == "stablelm" and "_layernorm.norms." in key:
            layer, which = key.split(".")[2], key.split(".")[4][0]  # which: q or k
            stacked.setdefault(f"blk.{layer}.attn_{which}_norm.weight", []).append(key)
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            unknown.append(key)
            continue
        if arch == "llama" and key.endswith(("q_proj.weight", "q_proj.bias")):
            load = _then(load, lambda w: _permute(w, cfg.num_attention_heads))
        elif arch == "llama" and key.endswith(("k_proj.weight", "k_proj.bias")):
            load = _then(load, lambda w: _permute(w, cfg.num_key_value_heads))
        elif arch in ("gemma2", "gemma3") and key.endswith("norm.weight"):
            load = _then(load, lambda w: w + 1.0)
        elif arch == "gpt2" and key.endswith((".c_attn.weight", ".c_proj.weight",
                                              ".c_fc.weight")):
            load = _then(load, lambda w: np.ascontiguousarray(w.T))
            shape = shape[::-1]
        if name == "token_embd.weight":
            embedding = (shape, load)
        yield _Tensor(name, shape, load)
    if unknown:
        raise ValueError(f"no GGUF name for the tensors {unknown[:5]} of {checkpoint} "
                         f"({arch}): is it an ordinary {cfg.model_type} checkpoint?")
    if arch == "gpt2" and (tied or "lm_head.weight" not in found):
        shape, load = embedding  # llama.cpp's GPT-2 reads its head from `output` only
        yield _Tensor("output.weight", shape, load)
    for name, keys in sorted(stacked.items()):
        keys = sorted(keys, key=lambda k: int(k.rsplit(".", 2)[-2]))
        shape = (len(keys), *found[keys[0]][1])
        loads = [_reader(found[k][0], k) for k in keys]
        yield _Tensor(name, shape, lambda loads=loads: np.stack([ld() for ld in loads]))
    yield from _rope_tensors(cfg, arch)


def _then(load: Callable[[], np.ndarray], f: Callable[[np.ndarray], np.ndarray]):
    return lambda: f(load())


def _rope_tensors(cfg, arch: str) -> Iterator[_Tensor]:
    """llama.cpp's rope factor tensors: Llama 3's `rope_freqs`, Phi-3's LongRoPE factors."""
    rope = _rope(cfg)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        dim = _head_dim(cfg)
        freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        factor = rope.get("factor", 8.0)
        low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        old = rope.get("original_max_position_embeddings", 8192)
        factors = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        values = np.array(factors, dtype=np.float32)
        yield _Tensor("rope_freqs.weight", values.shape, lambda: values)
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        for which in ("long", "short"):
            values = np.array(rope[f"{which}_factor"], dtype=np.float32)
            yield _Tensor(f"rope_factors_{which}.weight", values.shape,
                          lambda values=values: values)


# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def _tokenizer(writer, checkpoint: Path, cfg) -> None:
    """tokenizer.json as llama.cpp's `gpt2` (byte-level BPE) tokenizer: tokens in id order
    padded to the model's vocabulary with `[PAD<id>]` (unused), special added tokens as
    control and other added tokens as user-defined, the merges, the special ids, whether
    BOS is added, and the chat template."""
    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{checkpoint} has no tokenizer.json: save the tokenizer with "
                         "save_pretrained first")
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec["model"]
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ValueError(f"the tokenizer of {checkpoint} is not a byte-level BPE (GPT-2's "
                         "scheme), the only kind written as GGUF here")
    ids = dict(model["vocab"])
    types = {}
    for added in spec.get("added_tokens", []):
        ids[added["content"]] = added["id"]
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    by_id = {i: t for t, i in ids.items()}
    if max(by_id) >= cfg.vocab_size:
        raise ValueError(f"the tokenizer of {checkpoint} has ids up to {max(by_id)}, beyond "
                         f"the model's vocabulary of {cfg.vocab_size}")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(cfg.vocab_size)]
    token_types = [types.get(i, NORMAL if i in by_id else UNUSED)
                   for i in range(cfg.vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not merges:
        raise ValueError(f"the tokenizer of {checkpoint} has no merges: llama.cpp's gpt2 "
                         "tokenizer needs them")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)

    config_path = checkpoint / "tokenizer_config.json"
    tok_cfg = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}

    def token_id(field: str) -> int | None:
        value = tok_cfg.get(field)
        if isinstance(value, dict):
            value = value.get("content")
        if value in ids:
            return ids[value]
        value = getattr(cfg, f"{field}_id", None)
        return value[0] if isinstance(value, list) else value

    for field, add in (("bos_token", writer.add_bos_token_id),
                       ("eos_token", writer.add_eos_token_id),
                       ("unk_token", writer.add_unk_token_id),
                       ("pad_token", writer.add_pad_token_id)):
        if (i := token_id(field)) is not None:
            add(i)
    add_bos = tok_cfg.get("add_bos_token")
    if add_bos is None:  # newer checkpoints say it in the post-processor's template only
        single = (spec.get("post_processor") or {}).get("single") or []
        first = single[0] if single else {}
        add_bos = "SpecialToken" in first and token_id("bos_token") is not None and \
            ids.get(first["SpecialToken"]["id"]) == token_id("bos_token")
    writer.add_add_bos_token(bool(add_bos))
    template = tok_cfg.get("chat_template")
    if template is None and (checkpoint / "chat_template.jinja").is_file():
        template = (checkpoint / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, str):
        writer.add_chat_template(template)


# Split patterns of tokenizer.json -> llama.cpp's pre-tokenizer name
# (tokenizer.ggml.pre), which picks llama.cpp's own copy of the pattern.
_LLAMA3_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
                 "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
                "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def _pre_tokenizer(spec: dict) -> str:
    """llama.cpp's name for how this tokenizer splits text before BPE: Llama 3's and Qwen 2's
    patterns by their regex, GPT-2's (a ByteLevel pre-tokenizer that splits by its own
    regex) as `gpt-2`, SmolLM's (single digits, then GPT-2's) as `smollm`, anything else
    `default`."""
    text = json.dumps(spec.get("pre_tokenizer"))
    if json.dumps(_LLAMA3_SPLIT)[1:-1] in text:
        return "llama-bpe"
    if json.dumps(_QWEN2_SPLIT)[1:-1] in text:
        return "qwen2"
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if not steps or kinds[-1] != "ByteLevel" or not steps[-1].get("use_regex", True):
        return "default"
    if kinds == ["ByteLevel"]:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    return "default"
