"""Sparrow's draft head for Video-LLMs (Zhang et al., ACL 2026, arXiv 2602.15318): no visual KV in the draft.

The head is an EAGLE-3 head (`sparrow.heads.eagle`; same tensors, so it saves in the SpecForge layout, with a
`"sparrow"` entry in config.json that sparrow reads) drafted and trained in Sparrow's way:

* Text-anchored window attention with hidden-state reuse (VATA): the head has rows only for *text* positions
  (row t reads the token x[t + 1] and the target's hidden states at t, as in EAGLE), and each row attends to the
  last `text_window` text rows only. Visual placeholder positions get no row and no KV: the target's deep text
  states already carry what the draft needs from the video, so the draft's cost does not depend on the number
  of frames.
* Intermediate-layer visual state bridging (IVSB), training only: rows at visual positions are trained too,
  fed the target's intermediate-layer state (`bridge_layer`, in every fused slot) instead of its low/mid/high
  mix, with the target's distribution as the label (weight `bridge_weight`). No text row attends to them (as at
  inference, where they do not exist); they teach `fc` and the layer to read semantic-rich visual states.
* Multi-token prediction (MTP): the text rows are trained for `ttt_steps` draft depths on the head's own outputs
  (EAGLE-3's training-time test), the exposure bias Sparrow's MTP addresses.

From Python: `train_sparrow` on `video_features`; from the command line, `sparrow train head --arch sparrow` (the
target's answers about videos: `sparrow.training.video_data`; steps: `sparrow_step` in `sparrow.training.trainer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from sparrow.errors import UserError
from sparrow.heads.eagle import EagleHead, new_eagle_head
from sparrow.heads.longspec import window_mask


@dataclass(frozen=True)
class SparrowSpec:
    """What makes an EAGLE-3 head a Sparrow head (saved as config.json's "sparrow" entry)."""

    text_window: int = 32  # text rows a row attends to (its own included)
    bridge_layer: int = 1  # transformers' hidden_states index of the intermediate layer IVSB feeds visual rows

    def __post_init__(self) -> None:
        if self.text_window < 1:
            raise UserError(f"a Sparrow head's text_window must be >= 1, got {self.text_window}")


def new_sparrow_head(model: nn.Module, generator: torch.Generator | None = None, text_window: int = 32,
                     bridge_layer: int | None = None, **options: Any) -> EagleHead:
    """An EAGLE-3 head for the Video-LLM `model` (its language model's sizes) with a SparrowSpec attached."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer = text.num_hidden_layers // 2 if bridge_layer is None else bridge_layer
    if not 0 <= layer <= text.num_hidden_layers:
        raise UserError(f"bridge_layer {layer} is not a hidden state of the target (0..{text.num_hidden_layers})")
    head = new_eagle_head(model, "eagle3", generator, **options)
    head.sparrow = SparrowSpec(text_window, layer)
    return head


def spec_of(head: nn.Module) -> SparrowSpec | None:
    return getattr(head, "sparrow", None)


def text_anchored_mask(text: Tensor, window: int) -> Tensor:
    """[m, m] bool over rows in sequence order, `text` [m] bool: a text row sees the text rows among the last
    `window` text rows up to itself; a visual row (IVSB, training only) sees the last `window` text rows before it
    and itself. No row sees another visual row."""
    m = text.numel()
    rank = text.long().cumsum(0) - 1  # a text row's rank among the text rows; a visual row: the rank before it
    seen = window_mask(rank, rank, window) & text[None, :]
    order = torch.arange(m, device=text.device)
    causal = order[None, :] <= order[:, None]
    return (seen & causal) | torch.eye(m, dtype=torch.bool, device=text.device)


@dataclass(frozen=True)
class VideoFeatures:
    """One Video-LLM sequence as a Sparrow head trains on it."""

    tokens: Tensor  # [n] int64
    visual: Tensor  # [n] bool: visual placeholder positions
    hidden: Tensor  # [n, fused_width] the target's hidden states of the head's layers, concatenated
    bridged: Tensor  # [n, fused_width] the bridge layer's state, repeated in every slot
    logits: Tensor  # [n, vocab]: row t scores token t + 1


@torch.no_grad()
def video_features(model: nn.Module, head: EagleHead, input_ids: Tensor, model_inputs: dict[str, Any],
                   continuation: Tensor, visual_ids: Sequence[int]) -> VideoFeatures:
    """Run the Video-LLM over a prompt (with its pixels: `model_inputs` as the processor gave them) and then
    `continuation` ([c] ids) on its cache, collecting the head's features and the target's logits."""
    device = next(model.parameters()).device
    layers, bridge = head.config.target_layers, spec_of(head).bridge_layer
    cache = DynamicCache(config=model.config)
    parts = [model(input_ids=input_ids.to(device)[None], cache=cache, use_cache=True,
                   output_hidden_states=True, **model_inputs)]
    if continuation.numel():
        parts.append(model(input_ids=continuation.to(device)[None], cache=cache, use_cache=True,
                           output_hidden_states=True))
    states = [torch.cat([p.hidden_states[i][0] for p in parts]) for i in range(len(parts[0].hidden_states))]
    tokens = torch.cat([input_ids.to(device), continuation.to(device)])
    visual = torch.isin(tokens, torch.tensor(list(visual_ids), device=device, dtype=tokens.dtype))
    return VideoFeatures(tokens, visual, torch.cat([states[i] for i in layers], -1),
                         torch.cat([states[bridge]] * len(layers), -1), torch.cat([p.logits[0] for p in parts]))


