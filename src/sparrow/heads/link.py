"""DeviceLink: the one door between a head's device and its target's (Dovetail's CPU/GPU split).

Dovetail (Zhang et al., EMNLP 2025) runs the draft on one device and the target on another and keeps the
transfers small: only token ids (committed tokens in, draft tokens out) and the target's hidden states of the
committed rows cross; a sampled draft also sends its distribution q, which the rejection verifier needs. Every
crossing goes through `to_draft` / `to_target`, which check the kind of tensor and count what moved, so a test
can assert that nothing else crosses, even where both devices are the same hardware (two CPU placements).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

KINDS = ("ids", "hidden", "probs")


@dataclass
class DeviceLink:
    draft: torch.device  # where the head runs
    target: torch.device  # where the target runs
    moved: Counter[str] = field(default_factory=Counter)  # kind -> tensors moved across (split links only)
    bytes: int = 0  # bytes moved across (split links only)

    def __post_init__(self) -> None:
        self.draft, self.target = torch.device(self.draft), torch.device(self.target)

    @property
    def split(self) -> bool:
        """The head and the target sit on different devices (as named: "cpu" and "cpu:0" count as two)."""
        return self.draft != self.target

    def to_draft(self, tensor: Tensor, kind: str) -> Tensor:
        return self._move(tensor, self.draft, kind)

    def to_target(self, tensor: Tensor, kind: str) -> Tensor:
        return self._move(tensor, self.target, kind)

    def _move(self, tensor: Tensor, device: torch.device, kind: str) -> Tensor:
        """ids: integer tensors; hidden: [layers, m, D] float; probs: [n, vocab] float."""
        assert kind in KINDS, kind
        assert (kind == "ids") != tensor.is_floating_point(), (kind, tensor.dtype)
        assert kind != "hidden" or tensor.ndim == 3, (kind, tuple(tensor.shape))
        if self.split:
            self.moved[kind] += 1
            self.bytes += tensor.numel() * tensor.element_size()
        return tensor.to(device)
