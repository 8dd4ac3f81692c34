"""Which torch device a model runs on."""

from __future__ import annotations

import torch

from sparrow.errors import UserError


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> CUDA if available, else the CPU; otherwise parse and check ``device``."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"invalid device {device!r}: expected e.g. 'cpu', 'cuda', 'cuda:0'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} was requested but CUDA is not available")
    return dev

