"""Head checkpoints in the layout serving engines read: a directory with `config.json` and `model.safetensors`.

EAGLE-3, as SpecForge exports it and vLLM / SGLang load it unchanged: `config.json` with
`architectures: ["LlamaForCausalLMEagle3"]`, `hidden_size`, `draft_vocab_size`, `vocab_size`, the Llama layer
fields (`num_hidden_layers: 1`), optionally `target_hidden_size` and `eagle_aux_hidden_state_layer_ids`
(top level and in `eagle_config`). Those ids are SpecForge's and SGLang's: id i is the OUTPUT of decoder layer i,
= transformers' `hidden_states[i + 1]` (SGLang captures the input of layer i + 1; SpecForge's default ids are
[1, L // 2 - 1, L - 4], i.e. hidden_states 2, L // 2, L - 3; id -1 is the embedding output). Sparrow keeps
hidden_states indices inside (`HeadConfig.target_layers`) and converts at the file boundary (`layer_ids_of`,
`target_layers_of`). Heads saved by sparrow carry `"sparrow_format": 2`; older sparrow heads (format 1, no such
key) wrote hidden_states indices under the same name and are recognised by their exact key set
(`is_format1`) and read with their own meaning. Tensors
`fc.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight`, `d2t` (int64 offsets: target id = draft id + d2t[draft id]) and `t2d` (bool over the target
vocabulary). No `embed_tokens.weight`: the target's embedding is used (one found is ignored).

EAGLE-1, as SafeAILab's heads and vLLM's `EagleLlamaForCausalLM` read it: a Llama `config.json` with
`num_hidden_layers: 1`; tensors `fc.weight` (and `fc.bias` if trained with one), `layers.0.*` without
`input_layernorm` (model.safetensors or pytorch_model.bin).

Sparrow-only extensions (Dovetail), which vLLM / SGLang's EAGLE loaders do not read: `"fusion": "gated"` in
config.json with the gate's tensors `gate.*` (and, for EAGLE-3, a `midlayer` without `input_layernorm` /
`hidden_norm` whose attention reads d, not 2d; for EAGLE-1 an `fc` over the feature alone), and
`num_hidden_layers` > 1 with the deeper layers as `layers.1.*` .. (EAGLE-1 heads of several layers follow
SafeAILab's / Dovetail's `layers.i.*` naming).

Quantized (sparrow's, for shipping): `manifest.json` + int8 or int4 safetensors shards (`sparrow.heads.quantized`);
`load_head` reads it transparently (checked, dequantized), `export_quantized` writes one from a dense head. An
EAGLE-3 head whose LM head still equals the target's rows of its draft vocabulary (trained with it frozen) is
exported without it: its config record says `"sparrow_lm_head": "target"` and `load_head` takes those rows from the
target (the 1.5B preset's head then fits 16 MB at int4).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from sparrow.errors import UserError
from sparrow.heads.config import HeadConfig, default_layers
from sparrow.heads.eagle import EagleHead, TargetParts
from sparrow.heads.longspec import load_longspec, save_longspec
from sparrow.heads.quantized import MANIFEST as QUANTIZED_MANIFEST
from sparrow.heads.quantized import (
    QuantizedExport,
    dequantize_rows,
    is_quantized_dir,
    read_quantized,
    replace_quantized,
    write_quantized,
)
from sparrow.heads.sparrow_head import SparrowSpec
from sparrow.models.presets import PRESETS
from sparrow.paths import default_cache_dir
from sparrow.runtime.quant import DynamicInt8Linear, QuantizedLinear

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE1_ARCHITECTURE = "LlamaForCausalLM"
WEIGHTS = "model.safetensors"
FORMAT_KEY = "sparrow_format"
FORMAT = 2  # 2: eagle_aux_hidden_state_layer_ids in SpecForge's / SGLang's meaning (1: hidden_states indices)
LAYER_IDS = "eagle_aux_hidden_state_layer_ids"
LM_HEAD_KEY = "sparrow_lm_head"  # "target": an export without lm_head.weight, whose rows are the target's


def layer_ids_of(target_layers: Sequence[int]) -> list[int]:
    """hidden_states indices -> the layer ids SpecForge and SGLang read (output of decoder layer i = index i + 1)."""
    return [int(i) - 1 for i in target_layers]


def is_format1(raw: dict[str, Any]) -> bool:
    """Whether a config.json is one sparrow wrote before format 2: no `sparrow_format` (or 1, as an int8 export of
    such a head records it), and the layer ids written both at the top level and in `eagle_config` (equal), beside
    sparrow's `bias` key (SpecForge writes neither pair)."""
    if FORMAT_KEY in raw:  # an int8 export of a format-1 head says so
        return raw[FORMAT_KEY] == 1
    if "bias" not in raw:
        return False
    nested = raw.get("eagle_config")
    return isinstance(nested, dict) and raw.get(LAYER_IDS) is not None and nested.get(LAYER_IDS) == raw[LAYER_IDS]


def target_layers_of(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """The hidden_states indices an EAGLE-3 config.json asks for: its layer ids + 1 (SpecForge / SGLang), or a
    format-1 sparrow head's ids as they are, or the default when it lists none (EAGLE-1: the final state)."""
    ids = raw.get(LAYER_IDS) or (raw.get("eagle_config") or {}).get(LAYER_IDS)
    if not ids or arch != "eagle3":
        return default_layers(arch, num_layers)
    shift = 0 if is_format1(raw) else 1
    return tuple(int(i) + shift for i in ids)


def head_config_json(config: HeadConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of a head (SpecForge's keys; EAGLE-1: SafeAILab's Llama config)."""
    eagle3 = config.arch == "eagle3"
    record: dict[str, Any] = {
        "architectures": [EAGLE3_ARCHITECTURE if eagle3 else EAGLE1_ARCHITECTURE],
        "model_type": "llama", "hidden_act": config.hidden_act, "attention_bias": False, "attention_dropout": 0.0,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "num_hidden_layers": config.num_layers, "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."), "bias": config.fc_bias,
    }
    if config.fusion != "concat":
        record["fusion"] = config.fusion  # sparrow-only (see the module docstring)
    if eagle3:
        ids = layer_ids_of(config.target_layers)
        record.update(draft_vocab_size=config.draft_vocab_size, target_hidden_size=config.target_hidden_size,
                      eagle_aux_hidden_state_layer_ids=ids,
                      eagle_config={"use_aux_hidden_state": True, LAYER_IDS: ids})
    record[FORMAT_KEY] = FORMAT
    return record


def default_head_dir(target: str, cache_dir: str | Path | None = None) -> Path | None:
    """Where `sparrow train head --target PRESET` trains (and `--drafter eagle` without --head finds) the preset's
    head: <sparrow cache>/heads/<preset>; None for targets that are not presets (nothing names them reliably)."""
    name = target.strip().lower()
    if name not in PRESETS:
        return None
    return (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "heads" / name


SHIPPED = Path(__file__).parent / "shipped"
"""Heads shipped in the package: SHIPPED/<preset>/ holding a quantized export (manifest.json + shards)."""


def shipped_head_dir(target: str) -> Path | None:
    """The head shipped in the package for preset `target` (a quantized export or a dense head), else None (also
    for any target that is not a preset name)."""
    name = target.strip().lower()
    if name not in PRESETS:
        return None
    where = SHIPPED / name
    return where if (where / QUANTIZED_MANIFEST).is_file() or (where / "config.json").is_file() else None


def find_head(target: str, cache_dir: str | Path | None = None) -> Path | None:
    """The head `--drafter eagle` uses without --head for `target`: the one shipped in the package for that preset,
    else the one `sparrow train head` keeps in the user cache (default_head_dir), else None."""
    shipped = shipped_head_dir(target)
    if shipped is not None:
        return shipped
    trained = default_head_dir(target, cache_dir)
    if trained is not None and ((trained / "config.json").is_file() or is_quantized_dir(trained)):
        return trained
    return None


def save_head(head: EagleHead, directory: str | Path) -> Path:
    """Write `head` to `directory` (created) in its layout; returns the directory."""
    if head.config.arch == "longspec":  # sparrow-only layouts
        return save_longspec(head, directory)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_record(head), indent=2) + "\n")
    tensors = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    return directory


def config_record(head: EagleHead) -> dict[str, Any]:
    """The config.json record of an EAGLE head (a Sparrow head's spec included)."""
    record = head_config_json(head.config, head.fc.weight.dtype)
    spec = getattr(head, "sparrow", None)  # a Sparrow head: EAGLE-3 tensors, drafted text-anchored by sparrow
    if spec is not None:
        record["sparrow"] = {"text_window": spec.text_window, "bridge_layer": spec.bridge_layer}
    return record


def export_quantized(source: str | Path | EagleHead, directory: str | Path, bits: int = 8, replace: bool = False
                     ) -> QuantizedExport:
    """The int8 or int4 export (`sparrow.heads.quantized`) of a head: a dense head directory (config.json + weights,
    sparrow's or SpecForge's) or an EagleHead (an EAGLE-3 one whose LM head equals the target's rows goes without
    it); written into the new directory `directory`, or with `replace` swapped in for the export there."""
    if isinstance(source, EagleHead):
        config, tensors = exported_tensors(source)
    else:
        source = Path(source)
        where = f"head {str(source)!r}"
        if is_quantized_dir(source):
            raise UserError(f"{where} is already a quantized export")
        config, tensors = _read_config(source, where), _read_tensors(source)
        if "SparrowLongSpecHead" in (config.get("architectures") or []):
            raise UserError(f"{where} is a LongSpec head: the quantized export takes EAGLE-1/3 heads")
        tensors = _normalised(tensors, _arch(config, tensors, where) == "eagle3")
    config = {**config, FORMAT_KEY: config.get(FORMAT_KEY, FORMAT if not is_format1(config) else 1)}
    write = replace_quantized if replace else write_quantized
    return write(tensors, config, directory, bits=bits)


def exported_tensors(head: EagleHead) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(the config record, the tensors) a quantized export of `head` stores: all of its state but, for an EAGLE-3
    head whose LM head equals the target's rows, its LM head (the record then says `"sparrow_lm_head": "target"`)."""
    config, tensors = config_record(head), dict(head.state_dict())
    if head.config.arch == "eagle3" and _lm_head_is_targets(head):
        config[LM_HEAD_KEY] = "target"
        del tensors["lm_head.weight"]
    return config, tensors


def _lm_head_is_targets(head: EagleHead) -> bool:
    """Whether an EAGLE-3 head's LM head holds exactly the target's rows of its draft vocabulary (in the head's
    dtype: a head trained with its LM head frozen after `init_from_target`)."""
    weight = head.lm_head.weight
    try:
        rows = target_rows(head.target.lm_head, None, head.draft_to_target, "head")
    except UserError:
        return False
    return rows.shape == weight.shape and torch.equal(rows.to(weight), weight)


def target_rows(lm_head: torch.nn.Module, embed: torch.nn.Module | None, ids: Tensor, where: str) -> Tensor:
    """The target's LM-head rows `ids` (float32 for a quantized LM head, else its dtype): from a dense, int8 or
    dense-keeping int4 LM head, or from the input embedding `embed` when the LM head is tied to it (pass None when
    it is not)."""
    ids = ids.to(torch.long)
    if type(lm_head) is torch.nn.Linear:
        return lm_head.weight.detach()[ids.to(lm_head.weight.device)]
    if isinstance(lm_head, QuantizedLinear) and lm_head.dense is not None:
        return lm_head.dense.detach()[ids.to(lm_head.dense.device)]
    if isinstance(lm_head, DynamicInt8Linear):
        rows = ids.to(lm_head.scales.device)
        return dequantize_rows(lm_head.int8_weight()[rows], lm_head.scales[rows])
    if embed is not None:
        return embed.weight.detach()[ids.to(embed.weight.device)]
    raise UserError(f"{where} takes its LM head from the target's rows, but the target's LM head "
                    f"({type(lm_head).__name__}) keeps no dense weights: load the target without quantizing it")


def _tied_embedding(model: torch.nn.Module) -> torch.nn.Module | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return model.get_input_embeddings() if getattr(config, "tie_word_embeddings", False) else None


def _read_config(directory: Path, where: str) -> dict[str, Any]:
    if not (directory / "config.json").is_file():
        raise UserError(f"{where}: no config.json or {QUANTIZED_MANIFEST} (expected a directory saved by sparrow or "
                        "exported by SpecForge)")
    try:
        return json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{where}: config.json is not valid JSON ({error})") from None


def _read_tensors(directory: Path) -> dict[str, Tensor]:
    if (directory / WEIGHTS).is_file():
        return load_file(str(directory / WEIGHTS))
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise UserError(f"head {str(directory)!r} has no {WEIGHTS} or pytorch_model.bin")


def _normalised(tensors: dict[str, Tensor], eagle3: bool) -> dict[str, Tensor]:
    """Key spellings of other exports -> sparrow's: a `model.` prefix dropped, vLLM's `layers.0.` -> `midlayer.`
    (EAGLE-3), the target's embedding dropped."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("embed_tokens."):
            continue
        if eagle3 and name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        out[name] = tensor
    return out


def _arch(config: dict[str, Any], tensors: dict[str, Tensor], where: str) -> str:
    architectures = " ".join(config.get("architectures") or [])
    if "Eagle3" in architectures or any(k.startswith("midlayer.") for k in tensors):
        return "eagle3"
    if "fc.weight" in tensors and any(k.startswith("layers.0.") for k in tensors):
        return "eagle1"
    raise UserError(f"{where} is not an EAGLE-1 or EAGLE-3 head: expected architectures "
                    f"[{EAGLE3_ARCHITECTURE!r}] with midlayer.* tensors, or fc.weight with layers.0.*")


def target_sizes(model: torch.nn.Module) -> tuple[int, int, int]:
    """(hidden size, vocabulary = logit width, number of decoder layers) of a transformers causal LM."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else config.vocab_size
    return config.hidden_size, vocab, config.num_hidden_layers


def check_fits(config: HeadConfig, model: torch.nn.Module, where: str = "head") -> None:
    """Refuse a head whose hidden size, target layers or vocabulary do not fit `model`, naming both sizes."""
    hidden, vocab, num_layers = target_sizes(model)
    if config.hidden_size != hidden or config.target_hidden_size != hidden:
        size = config.hidden_size if config.hidden_size != hidden else config.target_hidden_size
        raise UserError(f"{where} has hidden size {size} but the target's is {hidden}; "
                        "a head must be trained for this target")
    if config.vocab_size != vocab:
        raise UserError(f"{where} has a vocabulary of {config.vocab_size} tokens but the target's has {vocab}; "
                        "a head must be trained for this target")
    if any(not 0 <= i <= num_layers for i in config.target_layers):
        raise UserError(f"{where} reads target layer ids {layer_ids_of(config.target_layers)} (outputs of those "
                        f"decoder layers) but the target has {num_layers} layers (ids -1..{num_layers - 1})")


def load_head(directory: str | Path, model: torch.nn.Module, device: torch.device | str | None = None) -> EagleHead:
    """The head saved in `directory`, bound to the target `model` (a transformers causal LM) and placed in its
    dtype on its device, or on `device` (Dovetail's split). Refuses (UserError) a head that does not fit."""
    directory = Path(directory)
    where = f"head {str(directory)!r}"
    if is_quantized_dir(directory):  # dequantized to float32 here, to the target's dtype by load_state_dict
        raw, tensors = read_quantized(directory)
    else:
        raw, tensors = _read_config(directory, where), _read_tensors(directory)
    if "SparrowLongSpecHead" in (raw.get("architectures") or []):
        return load_longspec(raw, tensors, model, device, where)
    arch = _arch(raw, tensors, where)
    tensors = _normalised(tensors, arch == "eagle3")
    _, vocab, num_layers = target_sizes(model)
    config = _config(raw, arch, num_layers, "fc.bias" in tensors, where)
    check_fits(config, model, where)
    parameter = next(model.parameters())
    head = EagleHead(config, TargetParts.of(model), device=device if device is not None else parameter.device,
                     dtype=parameter.dtype)
    if arch == "eagle3" and "d2t" not in tensors:  # a full-vocabulary head may leave the maps out
        if config.draft_vocab_size != config.vocab_size:
            raise UserError(f"{where} has a draft vocabulary of {config.draft_vocab_size} but no d2t map")
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    if arch == "eagle3" and raw.get(LM_HEAD_KEY) == "target" and "lm_head.weight" not in tensors and "d2t" in tensors:
        ids = torch.arange(config.draft_vocab_size) + tensors["d2t"].long()
        if int(ids.max()) >= vocab:
            raise UserError(f"{where}: d2t maps a draft token to target id {int(ids.max())}, beyond the target's "
                            f"vocabulary of {vocab}")
        lm_head = model.get_output_embeddings()
        tensors["lm_head.weight"] = target_rows(lm_head, _tied_embedding(model), ids, where).float().cpu()
    expected = head.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise UserError(f"{where} tensors do not match an {arch} head: missing {missing}, unexpected {unexpected}")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise UserError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(expected[name].shape)} from its config.json")
    if arch == "eagle3":
        tensors["t2d"], tensors["d2t"] = tensors["t2d"].bool(), tensors["d2t"].long()
    head.load_state_dict(tensors, strict=True)
    if isinstance(raw.get("sparrow"), dict):
        try:
            head.sparrow = SparrowSpec(**raw["sparrow"])
        except TypeError as error:
            raise UserError(f"{where}: config.json's \"sparrow\" entry is not understood ({error})") from None
    if arch == "eagle3" and int(head.draft_to_target.max()) >= vocab:
        raise UserError(f"{where}: d2t maps a draft token to target id {int(head.draft_to_target.max())}, "
                        f"beyond the target's vocabulary of {vocab}")
    return head.eval().requires_grad_(False)


def _config(raw: dict[str, Any], arch: str, num_layers: int, fc_bias: bool, where: str) -> HeadConfig:
    try:
        d, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        vocab = int(raw["vocab_size"])
        return HeadConfig(
            arch=arch, hidden_size=d, intermediate_size=int(raw["intermediate_size"]), num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or d // heads), vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab) if arch == "eagle3" else vocab,
            target_layers=target_layers_of(raw, arch, num_layers),
            target_hidden_size=int(raw.get("target_hidden_size") or d),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(raw.get("rope_theta", 10000.0)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope_scaling=raw.get("rope_scaling"), fc_bias=fc_bias,
            hidden_act=str(raw.get("hidden_act", "silu")), fusion=str(raw.get("fusion", "concat")),
            num_layers=int(raw.get("num_hidden_layers") or 1))
    except KeyError as missing:
        raise UserError(f"{where}: config.json lacks {missing.args[0]!r}") from None
