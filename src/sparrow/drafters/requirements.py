"""What a drafter, its options and the weight formats need of the models, checked before any model loads.

`sparrow.load` (and `sparrow.generate`) call `check_models` with the model specs as given: it reads each model's
config.json (`sparrow.models.loading.read_config`, no weights; a loaded model's own config), so a combination the
model's family cannot run is refused in one line naming the options, not after the models loaded:

* a drafter that needs a draft model given none;
* compile on a vision-language model or one with sliding-window layers (the target, and a draft-model's draft,
  which compiles too);
* a weight format with no kernel on the device (w8a8 off the CPU, int4 on an old GPU);
* the sparse drafter on a target with sliding-window layers (they keep no full prompt cache to select from);
* visual-prune drafting with a text-only model; a draft-KV policy (`draft_kv`) on a text-only draft or one with
  sliding-window layers;
* layer-skip trees on a sliding-window target, and layer-skip with no skip set given or shipped for the target;
* eagle with no head (none given, none shipped or trained for the target) or a `head` that is no directory;
* a draft vocabulary larger than the vocabulary, or on a drafting model with final logit soft-capping.

The drafters keep their own checks (they can be built from loaded models directly): these are the same
conditions, read from the config. Where a config cannot be read without loading (a GGUF file, a preset not yet
cached), the model-dependent checks wait for the loaded model, as the drafters' own do.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from sparrow.drafters.eagle import trained_head
from sparrow.drafters.layer_skip import find_record
from sparrow.drafters.registry import REGISTRY
from sparrow.errors import UserError
from sparrow.models import LoadedModel
from sparrow.models.loading import read_config
from sparrow.runtime.compiled import check_compilable_config, windowed
from sparrow.runtime.devices import resolve_device
from sparrow.runtime.quant import check_device

ModelSpec = str | LoadedModel  # what sparrow.load takes: a preset, path or hub id, or a loaded model
LM_HEAD_OF_TARGET = ("quantized-self", "layer-skip")  # draft_vocab reduces the target's own LM head
LM_HEAD_OF_DRAFT = ("draft-model",)  # draft_vocab reduces the draft model's LM head


def check_models(drafter: str, options: Mapping[str, Any], target: ModelSpec, draft: ModelSpec | None, *,
                 device: str | torch.device | None = None, compile: bool = False, quant: str | None = None,
                 draft_quant: str | None = None) -> None:
    """Refuse (UserError, one line) what `drafter` with `options` (its builder's keyword options) cannot run on these
    models: `draft` is the draft model the drafter will run (None: none); `device` as sparrow.load takes it;
    `quant` / `draft_quant` the formats asked for (None: dense, "auto": chosen later among those that run)."""
    where = next(target.model.parameters()).device if isinstance(target, LoadedModel) else resolve_device(device)
    for fmt in (quant, draft_quant):
        if fmt not in (None, "auto"):
            check_device(fmt, where)
    if drafter in REGISTRY and REGISTRY[drafter].needs_draft_model and draft is None:
        raise UserError(f"drafter {drafter!r} needs a draft model (--draft / draft=)")
    name = target.name if isinstance(target, LoadedModel) else target
    target_config = read_config(target)
    draft_config = read_config(draft) if draft is not None else None
    if compile and target_config is not None:
        check_compilable_config(target_config, f"target {name!r}")
    if compile and drafter == "draft-model" and draft_config is not None:
        check_compilable_config(draft_config, "the draft model")
    _check_drafter(drafter, options, name, target_config, draft_config, draft is not None)
    if drafter == "draft-model" and target_config is not None and draft_config is not None:
        _check_same_vocab(name, draft, target_config, draft_config)
    _check_draft_vocab(drafter, options.get("draft_vocab"), target_config,
                       draft_config if drafter in LM_HEAD_OF_DRAFT else target_config)


def _check_drafter(drafter: str, options: Mapping[str, Any], name: str, target: PretrainedConfig | None,
                   draft: PretrainedConfig | None, has_draft: bool) -> None:
    if drafter == "sparse" and target is not None and windowed(target):
        raise UserError(f"drafter 'sparse' needs a target whose layers all use full attention; {name!r} has "
                        "sliding-window layers, which keep no full prompt cache to select from")
    if drafter == "visual-prune":
        drafting = draft if has_draft else target
        if drafting is not None and not vlm(drafting):
            which = "draft model" if has_draft else f"target {name!r} (drafting itself without a draft)"
            raise UserError(f"drafter 'visual-prune' prunes visual tokens, and the {which} is a text-only model; "
                            "use a vision-language target, and a small VLM of its family as the draft (or none)")
    if options.get("draft_kv") is not None:
        drafting = draft if has_draft else target
        if drafter == "draft-model" and drafting is not None and not vlm(drafting):
            raise UserError("--draft-kv cuts a draft's *visual* KV, and the draft model is text-only; use a "
                            "vision-language draft of the target's family, or --drafter sparse / visual-prune")
        if drafting is not None and windowed(drafting):
            raise UserError(f"--draft-kv needs a drafting model whose layers all use full attention, and "
                            f"{'the draft model' if drafting is draft else repr(name)} has sliding-window layers")
    if drafter == "layer-skip":
        if options.get("tree_budget") and target is not None and windowed(target):
            raise UserError(f"--drafter layer-skip with a draft tree (--tree-budget) needs a target without "
                            f"sliding-window layers, and {name!r} has some; use a chain (--tree-budget 0)")
        if options.get("skip_set") is None and options.get("skip_file") is None and find_record(name) is None:
            raise UserError(f"--drafter layer-skip: no tuned skip set ships for model {name!r}; run "
                            f"`sparrow tune layer-skip --target {name}` and pass skip_file=..., or pass skip_set=...")
    if drafter == "eagle":
        head = options.get("head")
        if head is None:
            trained_head(name)  # refuses, naming --head and `sparrow train head`
        elif isinstance(head, (str, Path)) and not Path(head).expanduser().is_dir():
            raise UserError(f"--head {str(head)!r} is not a directory (a head: config.json and model.safetensors, "
                            "exported by SpecForge or saved by `sparrow train head`)")


def _check_same_vocab(name: str, draft: ModelSpec, target: PretrainedConfig, drafting: PretrainedConfig) -> None:
    """The draft-model drafter's draft must share the target's vocabulary (as the loaded drafter checks again on
    the logits' width): refused here before either model loads, with the drafters that would run."""
    ours, theirs = text_config(target).vocab_size, text_config(drafting).vocab_size
    if ours is not None and theirs is not None and ours != theirs:
        what = draft.name if isinstance(draft, LoadedModel) else draft
        raise UserError(f"the draft model {what!r} has another vocabulary than target {name!r} ({theirs} against "
                        f"{ours} tokens), and --drafter draft-model needs the same one: pass --draft with the "
                        "target's tokenizer, or --drafter cross-vocab (drafts across vocabularies), auto, suffix or "
                        "prompt-lookup")


def _check_draft_vocab(drafter: str, size: object, target: PretrainedConfig | None,
                       drafting: PretrainedConfig | None) -> None:
    """draft_vocab N over the target's vocabulary, on a drafting LM head without soft-capping."""
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        return  # None, 0, "auto" or a DraftVocab: the builder checks them against the loaded model
    vocab = text_config(target).vocab_size if target is not None else None
    if vocab is not None and size > vocab:
        raise UserError(f"--draft-vocab {size} is over the target's vocabulary of {vocab} tokens")
    if (drafter in (*LM_HEAD_OF_TARGET, *LM_HEAD_OF_DRAFT) and drafting is not None
            and getattr(text_config(drafting), "final_logit_softcapping", None) is not None):
        raise UserError("--draft-vocab: the drafting model caps its logits (final logit soft-capping), which a "
                        "reduced vocabulary cannot keep; drop --draft-vocab")


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config(decoder=True)


def vlm(config: PretrainedConfig) -> bool:
    """A vision-language model: its config has a vision tower's."""
    return getattr(config, "vision_config", None) is not None
