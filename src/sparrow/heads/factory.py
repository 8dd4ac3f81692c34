"""new_head: a randomly initialised head of any kind (EAGLE-1/3, Dovetail's gated or deeper heads, LongSpec, Sparrow)
shaped for a target."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from sparrow.errors import UserError
from sparrow.heads.eagle import EagleHead, new_eagle_head
from sparrow.heads.longspec import new_longspec_head
from sparrow.heads.sparrow_head import new_sparrow_head


def new_head(model: nn.Module, arch: str = "eagle3", generator: torch.Generator | None = None,
             draft_vocab: Tensor | None = None, fusion: str = "concat", layers: int = 1,
             device: torch.device | str | None = None, **overrides: Any) -> EagleHead:
    """A randomly initialised head for the transformers causal LM `model`, in its dtype, on its device or on
    `device` (Dovetail's split), shaped like one of its layers (`overrides`: HeadConfig fields, e.g.
    intermediate_size, target_layers). draft_vocab: the target ids of a reduced EAGLE-3 draft vocabulary
    ([draft_vocab_size]; default: all); fusion: "concat" (EAGLE) or "gated" (Dovetail); layers: decoder layers.
    arch "longspec": a LongSpec head (`sparrow.heads.longspec.new_longspec_head`; overrides: window, kv_layer);
    arch "sparrow": an EAGLE-3 head with a SparrowSpec (`sparrow.heads.sparrow_head`) for Video-LLM targets."""
    if arch == "longspec":
        if fusion != "concat" or layers != 1 or draft_vocab is not None:
            raise UserError("a LongSpec head is one layer over the token embedding with the target's LM head: "
                            "fusion, layers and a draft vocabulary do not apply")
        return new_longspec_head(model, generator, device=device, **overrides)
    if arch == "sparrow":  # an EAGLE-3 head drafted and trained Sparrow's way (overrides: text_window, bridge_layer)
        return new_sparrow_head(model, generator, draft_vocab=draft_vocab, fusion=fusion, layers=layers,
                                device=device, **overrides)
    return new_eagle_head(model, arch, generator, draft_vocab, fusion, layers, device, **overrides)

