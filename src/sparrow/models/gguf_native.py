"""A model whose linear layers run on the GGUF file's own blocks (``--quant gguf``): no dequantized float copy.

The file is memory-mapped (`read_gguf`); every linear layer whose GGML type the kernels take (Q5_0, Q8_0, Q4_K,
Q6_K; see `sparrow.runtime.gguf_kernels`) becomes a `GGUFLinear` over a view of the mapped bytes (Q4_K, and Q6_K on
AVX-512 VNNI: over a packed copy of them made at load, the view's pages then released, `_release`), the token
embedding a `GGUFEmbedding` that dequantizes the rows it looks up; the small float tensors (norms, biases) and any
tensor of another type are dequantized into memory. The config and tokenizer come from the file's metadata as
`read_gguf` read it, built with transformers' own GGUF conversion tables once and then cached
(`_config_and_tokenizer`).

Architectures: qwen2 (the presets qwen2.5-coder-*) and llama (whose q / k rows the GGUF converter permuted: the
rows are put back, a copy of those two tensors only; not yet tested on a llama file). Others are refused with one
line.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import struct
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor, nn

from sparrow.errors import UserError
from sparrow.models import cache
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


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: shape[0] is the row length (in_features)
    data: np.ndarray  # uint8 [rows, row bytes], a view of the mapped file


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf(path: Path) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
    """(metadata, tensors) of a GGUF file (v2 / v3), the tensors' bytes memory-mapped. gguf.GGUFReader does the same
    but builds a numpy view per metadata item, slow on a vocabulary of 150k tokens (see docs/results/gguf-kernels.md);
    this reads the metadata with struct. Raises ValueError / OSError / struct.error on a file that is not one."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mapped)
    pos = 0

    def take(fmt: str) -> object:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def text() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

    def value(kind: int) -> object:
        nonlocal pos
        if kind == 8:
            return text()
        if kind == 9:
            inner, count = take("<I"), take("<Q")
            if inner in _SCALARS and inner != 7:
                size = struct.calcsize(_SCALARS[inner])
                items = np.frombuffer(buf, dtype=np.dtype(_SCALARS[inner]), count=count, offset=pos).tolist()
                pos += size * count
                return items
            return [value(inner) for _ in range(count)]
        return take(_SCALARS[kind])

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    pos = 4
    version, n_tensors, n_fields = take("<I"), take("<Q"), take("<Q")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}")
    fields: dict[str, object] = {}
    for _ in range(n_fields):
        key = text()
        fields[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = text()
        dims = tuple(take("<Q") for _ in range(take("<I")))
        infos.append((name, dims, take("<I"), take("<Q")))
    alignment = int(fields.get("general.alignment", 32))
    start = -(-pos // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        rows, row_bytes = int(np.prod(dims[1:], dtype=np.int64)), dims[0] // block * nbytes
        if start + offset + rows * row_bytes > len(mapped):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = mapped[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, qtype, dims, data)
    return fields, tensors


def _release(view: np.ndarray) -> None:
    """Drop the whole pages of a view of the mapped file from this process's resident memory (madvise DONTNEED: the
    mapping stays valid, a later read faults them back in from the page cache), once a layer holds a packed copy of
    them; else the packed Q4_K layers would count twice in the resident set (2.4 GB for the 1.07 GB 1.5B file)."""
    mapped = getattr(view, "_mmap", None)  # numpy's memmap keeps its mmap on every view
    if not isinstance(mapped, mmap.mmap) or not hasattr(mapped, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    base = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
    start = -(-(view.ctypes.data - base) // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (view.ctypes.data - base + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def _bytes(tensor: GGUFTensor) -> Tensor:
    """The tensor's bytes in the mapped file as uint8 [rows, row bytes] (a view: nothing copied)."""
    with warnings.catch_warnings():  # the mapping is read-only; the kernels only read it
        warnings.simplefilter("ignore")
        return torch.from_numpy(tensor.data)


def _float(tensor: GGUFTensor) -> Tensor:
    """The tensor dequantized (any type gguf knows) to float32, in HF's [rows, cols] order, in memory."""
    raw = np.asarray(tensor.data)
    if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        raw = raw.view(np.float32 if tensor.tensor_type == gguf.GGMLQuantizationType.F32 else np.float16)
    else:
        raw = gguf.quants.dequantize(raw, tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(raw, dtype=np.float32)).reshape(list(reversed(tensor.shape)))


def _unpermute_rows(rows: Tensor, heads: int) -> Tensor:
    """Undo the llama GGUF converter's q / k row permutation (per head: the two rotary halves interleaved)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(rows.shape)


def _linear(tensors: dict[str, GGUFTensor], base: str, module: nn.Linear, int8: bool, heads: int | None,
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
        layer = GGUFLinear(blocks, qtype, out_features, in_features, bias, int8, f"{base}.weight")
        if layer.kernel_type != qtype:  # the layer holds its own packed copy: the file's pages are not needed
            _release(tensor.data)
        return layer
    weight = _float(tensor)
    if heads is not None:
        weight = _unpermute_rows(weight, heads).contiguous()
    # --quant gguf runs on the CPU only (`check_device` refuses another device before loading): the model is built
    # on "meta", and a layer the kernels do not take is materialised where the rest of it lives
    dense = nn.Linear(in_features, out_features, bias=bias is not None, device="cpu")
    with torch.no_grad():
        dense.weight.copy_(weight)
        if bias is not None:
            dense.bias.copy_(bias)
    return dense.requires_grad_(False)


def _save_meta(config: object, tokenizer: object, directory: Path) -> None:
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _config_from_fields(fields: dict[str, object], tensor_names: Iterable[str]) -> object:
    """The transformers config of a qwen2 / llama file from the metadata `read_gguf` read: what transformers'
    `load_gguf_checkpoint` builds (its own GGUF_TO_TRANSFORMERS_MAPPING renames, defaults, tied embeddings),
    without its reader, which parses the vocabulary item by item. Raises ValueError where transformers would
    read the file otherwise (another architecture; a llama file it renames mistral)."""
    from transformers import CONFIG_MAPPING
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r}")
    if arch == "llama" and fields.get("general.name") == "mistral":
        raise ValueError("transformers reads this llama file as mistral")
    config: dict[str, object] = {"tie_word_embeddings": "output.weight" not in set(tensor_names)}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}).items():
        config.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in fields.items():
        prefix, _, rest = key.partition(".")
        if rest not in renames.get(prefix, {}) or renames[prefix][rest] in (None, -1):
            continue
        if isinstance(value, list) and len(value) == 1:  # as transformers parses a field: one item is the item
            value = value[0]
        config[renames[prefix][rest]] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in fields:
        config["vocab_size"] = len(fields["tokenizer.ggml.tokens"])
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)  # as AutoConfig.from_pretrained builds it


_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}


def _tokenizer_from_fields(fields: dict[str, object], config: object) -> object:
    """The tokenizer transformers builds for the file (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`: the
    class AutoTokenizer picks for `config`, its backend from transformers' `convert_gguf_tokenizer`, the special
    tokens, add_bos / add_eos and the chat template as its `get_gguf_tokenizer` reads them), from the metadata
    `read_gguf` read."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    grouped = {group: {name: fields[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in fields} for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, kwargs = grouped["tokenizer"], grouped["tokenizer_config"]
    if not isinstance(tokenizer_dict.get("tokens"), list):
        raise ValueError("no vocabulary in the metadata")
    if any("\ufffd" in text for key in ("tokens", "merges") for text in tokenizer_dict.get(key, ())):
        raise ValueError("a token or merge that is not UTF-8 (read_gguf replaced its bytes)")
    if tokenizer_dict.get("tokenizer_type") == "llama":  # transformers' get_gguf_tokenizer: llama.cpp's default
        kwargs.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = fields.get(f"tokenizer.ggml.{key}")
        kwargs[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    cls = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    if getattr(cls, "__name__", None) == "MistralCommonBackend" or getattr(config, "tokenizer_class", None):
        raise ValueError(f"transformers picks the tokenizer class otherwise ({getattr(cls, '__name__', cls)})")
    backend, extra = convert_gguf_tokenizer(fields["general.architecture"], tokenizer_dict)
    return cls(tokenizer_object=backend, **kwargs, **extra)


def _config_and_tokenizer(path: Path, say: Callable[[str], None] | None,
                          fields: dict[str, object] | None = None,
                          tensor_names: Iterable[str] | None = None) -> tuple[object, object]:
    """The file's transformers config and tokenizer: built once from the metadata `read_gguf` read (`fields` and
    `tensor_names`, read here if not given) by `_config_from_fields` / `_tokenizer_from_fields` (what transformers
    builds from the file, without its reader's 40 s on a 150k vocabulary), by transformers itself from the file if
    that fails (one line says why), then read from a small cache entry beside sparrow's other caches
    (`<cache>/gguf-meta/<file>-<size>`), written and verified by sparrow.models.cache."""
    from transformers import AutoConfig, AutoTokenizer  # lazily: heavy, only for this path

    report = say or (lambda message: None)
    stat = path.stat()
    entry = default_cache_dir() / "gguf-meta" / f"{path.stem}-{stat.st_size}"
    meta = {"kind": "gguf-meta", "file": path.name, "size": str(stat.st_size), "mtime_ns": str(stat.st_mtime_ns)}
    with cache.open_entry(entry, meta, report) as slot:
        if not slot.ready:
            report(f"reading the config and tokenizer of {path.name} (first time only) …")
            try:
                if fields is None or tensor_names is None:
                    fields, tensor_names = read_gguf(path)
                config = _config_from_fields(fields, tensor_names)
                tokenizer = _tokenizer_from_fields(fields, config)
            except Exception as exc:  # noqa: BLE001 - any failure: transformers' own (slow) reading instead
                report(f"{path.name}: the metadata's config / tokenizer via transformers' reader instead "
                       f"({type(exc).__name__}: {' '.join(str(exc).split())[:120]})")
                config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
                tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            if not slot.commit(functools.partial(_save_meta, config, tokenizer)):
                return config, tokenizer
    return AutoConfig.from_pretrained(str(entry)), AutoTokenizer.from_pretrained(str(entry))


def _set(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def build_model(path: Path, int8: bool = True, say: Callable[[str], None] | None = None, config: object = None,
                tokenizer: object = None) -> tuple[nn.Module, object, dict[str, list[str]]]:
    """(model, tokenizer, {"gguf": [layer names on GGUF blocks], "dense": [linear layers dequantized]}) from a GGUF
    file; the model in float32, eval mode, on the CPU. `config` / `tokenizer`: given instead of read from the file's
    metadata (a test's tiny model, written without a tokenizer)."""
    from transformers import AutoModelForCausalLM  # lazily: heavy, only for this path

    if not gk.available():
        raise UserError(f"--quant gguf needs the GGUF kernels, which could not be built here "
                        f"({gk.why_unavailable()})")
    try:
        fields, tensors = read_gguf(path)
    except (OSError, ValueError, KeyError, struct.error) as exc:  # not a GGUF file, or a damaged one
        raise UserError(f"{path}: not a readable GGUF file ({' '.join(str(exc).split())[:200]})") from exc
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{path.name}: --quant gguf runs the architectures {', '.join(ARCHITECTURES)}, not {arch!r}")
    if config is None or tokenizer is None:
        config, tokenizer = _config_and_tokenizer(path, say, fields, tensors)
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
