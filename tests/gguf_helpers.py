"""Tiny GGUF files for tests: a model's float weights quantized to Q8_0 (gguf.quants.quantize) and to Q4_K / Q6_K
(simple quantizers below: the `gguf` package has none for the K-quants; any valid blocks serve, since the reference
is gguf's own dequantization), written with gguf.GGUFWriter."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

Q8_0, Q4_K, Q6_K = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K


def _fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> Q4_K bytes [rows, cols / 256 * 144] (asymmetric per 32, 6-bit scales and mins)."""
    blocks = w.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(blocks.min(axis=-1), 0.0)
    scale = (blocks.max(axis=-1) - low) / 15.0  # [n, 8]
    d = np.maximum(scale.max(axis=-1) / 63.0, 1e-8).astype(np.float16).astype(np.float32)  # [n]
    dmin = np.maximum((-low).max(axis=-1) / 63.0, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / dmin[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round((blocks + (dmin[:, None] * mn)[..., None]) / step), 0, 15).astype(np.uint8).reshape(-1, 256)
    packed = np.zeros((len(blocks), 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    chunks = q.reshape(-1, 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([_fp16(d), _fp16(dmin), packed, qs], axis=1)
    return out.reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> Q6_K bytes [rows, cols / 256 * 210] (symmetric per 16, int8 scales)."""
    groups = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(groups).max(axis=-1) / 31.0  # [n, 16]
    d = np.maximum(scale.max(axis=-1) / 127.0, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d[:, None]), 1, 127).astype(np.int8)
    q = np.clip(np.round(groups / (d[:, None] * sc)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # [n, half, quarter, 32]
    ql = np.concatenate([q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4, q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4],
                        axis=-1).reshape(-1, 128)
    qh = (q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _fp16(d)], axis=1)
    return out.reshape(w.shape[0], -1)


def quantize(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == Q4_K:
        return quantize_q4_k(w)
    if qtype == Q6_K:
        return quantize_q6_k(w)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TYPES = {"attn_q": Q8_0, "attn_k": Q4_K, "attn_v": Q6_K, "attn_output": Q4_K, "ffn_gate": Q4_K, "ffn_up": Q4_K,
         "ffn_down": Q6_K, "token_embd": Q8_0, "output": Q6_K}  # a Q4_K_M-like mix


def write_gguf(model: torch.nn.Module, path: Path, tokenizer=None) -> Path:
    """`model` (a qwen2 HF model, dims multiples of 256) as a GGUF file of Q8_0 / Q4_K / Q6_K / F32 tensors, with its
    config and (a byte-level BPE `tokenizer`, as conftest.tiny_tokenizer makes) its tokenizer in the metadata."""
    writer = gguf.GGUFWriter(str(path), "qwen2")
    config = model.config
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if tokenizer is not None:
        spec = tokenizer.backend_tokenizer.to_str()
        import json

        bpe = json.loads(spec)["model"]
        vocab = sorted(bpe["vocab"].items(), key=lambda item: item[1])
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list([token for token, _ in vocab])
        writer.add_token_types([gguf.TokenType.NORMAL] * len(vocab))
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in bpe["merges"]])
        writer.add_eos_token_id(tokenizer.eos_token_id)
    for name, tensor in model.state_dict().items():
        parts, kind = name.rsplit(".", 1)[0].split("."), name.rsplit(".", 1)[1]
        if parts[:2] == ["model", "layers"]:
            base = f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:])]}"
        else:
            base = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[
                ".".join(parts)]
        values = tensor.detach().float().numpy()
        qtype = TYPES.get(base.split(".")[-1])
        if values.ndim == 2 and qtype is not None:
            writer.add_tensor(f"{base}.{kind}", quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(f"{base}.{kind}", values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
