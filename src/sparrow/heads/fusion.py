"""Dovetail's dynamic gating fusion (DGF) of a head's feature and token embedding (Zhang et al., EMNLP 2025).

EAGLE mixes the feature f and the embedding e by concatenation (EAGLE-1: fc(cat(e, f))). DGF replaces that with
a GRU-like learned gate, per channel:

    h1 = fc(f)                      (the head's `fc`: EAGLE-1 [D -> d]; EAGLE-3 already fused [3D -> d])
    h2 = SiLU(embed_proj(embed_norm(e)))
    z  = sigmoid(mix(cat(h1, h2)))  [2d -> d]
    h  = z * h1 + (1 - z) * h2

so the head can lean on the feature where it is informative and on the token where it is not. The gate's
tensors (`gate.embed_norm.weight`, `gate.embed_proj.weight`, `gate.mix.weight`, `gate.mix.bias`) are
sparrow-only: vLLM / SGLang's EAGLE loaders do not read them, so a gated head runs in sparrow only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sparrow.heads.layers import RMSNorm


class GatedFusion(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.embed_norm = RMSNorm(width, eps)
        self.embed_proj = nn.Linear(width, width, bias=False)
        self.mix = nn.Linear(2 * width, width, bias=True)

    def forward(self, embeds: Tensor, feature: Tensor) -> Tensor:
        """embeds [n, d] token embeddings, feature [n, d] (h1, already projected) -> [n, d] the gated mix."""
        assert embeds.shape == feature.shape, (tuple(embeds.shape), tuple(feature.shape))
        token = nn.functional.silu(self.embed_proj(self.embed_norm(embeds)))
        gate = self.mix(torch.cat([feature, token], -1)).sigmoid()
        return gate * feature + (1 - gate) * token

