"""A model whose linear layers run on the GGUF file's own blocks (``--quant gguf``): no dequantized float copy.

The file is memory-mapped (``gguf.GGUFReader``); every linear layer whose GGML type the kernels take (Q8_0, Q4_K,
Q6_K; see `sparrow.runtime.gguf_kernels`) becomes a `GGUFLinear` over a view of the mapped bytes, the token
embedding a `GGUFEmbedding` that dequantizes the rows it looks up; the small float tensors (norms, biases) and any
tensor of another type are dequantized into memory. The architecture comes from the file's metadata, read by
transformers (config and tokenizer, as the dense loader reads them).

Architectures: qwen2 (the presets qwen2.5-coder-*) and llama (whose q / k rows the GGUF converter permuted: the
rows are put back, a copy of those two tensors only). Others are refused with one line.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor, nn

from sparrow.errors import UserError
from sparrow.models.loading import LoadedModel
from sparrow.models.presets import PRESETS, open_gguf
from sparrow.models.quantization import GGUF, QuantizationInfo
from sparrow.paths import default_cache_dir
from sparrow.runtime import gguf_kernels as gk
from sparrow.runtime.attention import decode as decode_attention
from sparrow.runtime.devices import resolve_device
from sparrow.runtime.gguf_linear import GGUFEmbedding, GGUFLinear
from sparrow.runtime.quant import check_device

ARCHITECTURES = ("qwen2", "llama")
HF_TO_GGUF = {  # HF module name (layer i) -> GGUF tensor base name
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
TOP_LEVEL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_module: str) -> str | None:
    """The GGUF tensor base name of an HF module ('model.layers.3.mlp.up_proj' -> 'blk.3.ffn_up'), None if unknown."""
    if hf_module in TOP_LEVEL:
        return TOP_LEVEL[hf_module]
    parts = hf_module.split(".")
    if len(parts) >= 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        base = HF_TO_GGUF.get(".".join(parts[3:]))
        return f"blk.{parts[2]}.{base}" if base else None
    return None


def _field(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _bytes(tensor: gguf.ReaderTensor) -> Tensor:
    """The tensor's bytes in the mapped file as uint8 [rows, row bytes] (a view: nothing copied)."""
    data = tensor.data
    with warnings.catch_warnings():  # the mapping is read-only; the kernels only read it
        warnings.simplefilter("ignore")
        return torch.from_numpy(data.view(np.uint8).reshape(data.shape[0], -1))


def _float(tensor: gguf.ReaderTensor) -> Tensor:
    """The tensor dequantized (any type gguf knows) to float32, in HF's [rows, cols] order, in memory."""
    values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(
        [int(n) for n in reversed(tensor.shape)])


def _unpermute_rows(rows: Tensor, heads: int) -> Tensor:
    """Undo the llama GGUF converter's q / k row permutation (per head: the two rotary halves interleaved)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(rows.shape)


def _linear(tensors: dict[str, gguf.ReaderTensor], base: str, module: nn.Linear, int8: bool, heads: int | None,
            ) -> nn.Module:
    """A GGUFLinear over the file's blocks of `base`.weight where the kernels take its type, else a dense copy."""
    tensor = tensors[f"{base}.weight"]
    out_features, in_features = module.out_features, module.in_features
    if [int(n) for n in tensor.shape] != [in_features, out_features]:
        raise UserError(f"{base}.weight has shape {list(reversed([int(n) for n in tensor.shape]))}, the model's "
                        f"config wants [{out_features}, {in_features}]")
    bias = _float(tensors[f"{base}.bias"]) if module.bias is not None else None
    qtype = int(tensor.tensor_type)
    values = gk.BLOCKS.get(qtype, (0, 0))[0]
    if values and in_features % values == 0:
        blocks = gk.check_blocks(_bytes(tensor), qtype, out_features, in_features, f"{base}.weight")
        if heads is not None:
            blocks = _unpermute_rows(blocks, heads).contiguous()
        return GGUFLinear(blocks, qtype, out_features, in_features, bias, int8, f"{base}.weight")
    weight = _float(tensor)
    if heads is not None:
        weight = _unpermute_rows(weight, heads).contiguous()
    dense = nn.Linear(in_features, out_features, bias=bias is not None, device="cpu")
    with torch.no_grad():
        dense.weight.copy_(weight)
        if bias is not None:
            dense.bias.copy_(bias)
    return dense.requires_grad_(False)


def _set(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def build_model(path: Path, int8: bool = True, say: Callable[[str], None] | None = None, config: object = None,
                tokenizer: object = None) -> tuple[nn.Module, object, dict[str, list[str]]]:
    """(model, tokenizer, {"gguf": [layer names on GGUF blocks], "dense": [linear layers dequantized]}) from a GGUF
    file; the model in float32, eval mode, on the CPU. `config` / `tokenizer`: given instead of read from the file's
    metadata (a test's tiny model, written without a tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # lazily: heavy, only for this path

    if not gk.available():
        raise UserError(f"--quant gguf needs the GGUF kernels, which could not be built here "
                        f"({gk.why_unavailable()})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # not a GGUF file, or a damaged one
        raise UserError(f"{path}: not a readable GGUF file ({' '.join(str(exc).split())[:200]})") from exc
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{path.name}: --quant gguf runs the architectures {', '.join(ARCHITECTURES)}, not {arch!r}")
    tensors = {t.name: t for t in reader.tensors}
    if config is None:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if say is not None:
        say(f"building {path.name} on its GGUF blocks …")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layers: dict[str, list[str]] = {"gguf": [], "dense": []}
    tied = "output.weight" not in tensors
    for name, module in list(model.named_modules()):
        base = gguf_name(name)
        if isinstance(module, nn.Linear):
            if name == "lm_head" and tied:
                base = "token_embd"
            if base is None or f"{base}.weight" not in tensors:
                raise UserError(f"{path.name}: no tensor for the model's layer {name!r}")
            heads = None
            if arch == "llama" and name.endswith(("q_proj", "k_proj")):
                heads = config.num_attention_heads if name.endswith("q_proj") else config.num_key_value_heads
            layer = _linear(tensors, base, module, int8, heads)
            layers["gguf" if isinstance(layer, GGUFLinear) else "dense"].append(name)
            _set(model, name, layer)
        elif isinstance(module, nn.Embedding) and base == "token_embd":
            tensor = tensors["token_embd.weight"]
            qtype = int(tensor.tensor_type)
            if qtype in gk.BLOCKS and module.embedding_dim % gk.BLOCKS[qtype][0] == 0:
                layer = GGUFEmbedding(_bytes(tensor), qtype, module.num_embeddings, module.embedding_dim)
            else:
                layer = nn.Embedding.from_pretrained(_float(tensor), freeze=True)
            _set(model, name, layer)
    for name, param in list(model.named_parameters()):
        if not param.is_meta:
            continue
        module_name, _, kind = name.rpartition(".")
        base = gguf_name(module_name)
        if base is None or f"{base}.{kind}" not in tensors:
            raise UserError(f"{path.name}: no tensor for the model's parameter {name!r}")
        value = _float(tensors[f"{base}.{kind}"]).reshape(param.shape)
        _set(model, name, nn.Parameter(value, requires_grad=False))
    for name, module in list(model.named_modules()):  # rotary tables: computed from the config, on the CPU
        if any(b.is_meta for b in module.buffers(recurse=False)) and name.endswith("rotary_emb"):
            _set(model, name, type(module)(config=module.config))
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise UserError(f"{path.name}: the GGUF loader left {len(meta)} tensors unset ({', '.join(meta[:3])}, …)")
    model.generation_config.eos_token_id = model.generation_config.eos_token_id or tokenizer.eos_token_id
    return model.eval(), tokenizer, layers


def load_gguf_model(spec: str, *, device: str | torch.device | None = None, cache_dir: Path | str | None = None,
                    int8: bool = True, progress: bool = True) -> LoadedModel:
    """A preset name or a .gguf path -> a LoadedModel whose linear layers run on the file's own blocks (CPU, float32
    activations around them); `model.sparrow_quantization` names the layers on blocks and those dequantized."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"invalid model spec {spec!r}: --quant gguf takes a preset name or a .gguf file")
    dev = resolve_device(device)
    check_device(GGUF, dev)
    start = time.perf_counter()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    say = (lambda message: print(f"sparrow: {message}", file=sys.stderr, flush=True)) if progress else None
    preset = PRESETS.get(spec.strip().lower())
    path = Path(spec).expanduser()
    with contextlib.ExitStack() as stack:
        if preset is not None:
            path = stack.enter_context(open_gguf(preset, root, report=say))
        elif not (path.is_file() and path.suffix == ".gguf"):
            raise UserError(f"--quant gguf takes a preset ({', '.join(PRESETS)}) or a .gguf file, not {spec!r}")
        model, tokenizer, layers = build_model(path, int8=int8, say=say)  # the mapping outlives the file's name
    model.sparrow_quantization = QuantizationInfo(GGUF, 0, tuple(layers["gguf"]), tuple(layers["dense"]),
                                                  from_disk=True)
    decode_attention.use(model)
    if say is not None:
        say(f"loaded {spec} on its GGUF blocks ({len(layers['gguf'])} layers, "
            f"{len(layers['dense'])} dequantized) in {time.perf_counter() - start:.1f} s")
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec)
