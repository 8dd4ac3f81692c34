"""Quantized self-draft: the draft is a weight-only int4/int8 copy of the target itself.

The copy shares the target's tokenizer, vocabulary and (dense) embeddings and agrees with it on
almost every token, while a single-token forward reads 2-4x fewer weight bytes. It runs as an
ordinary draft model (own KV cache, lazy rollback) and the unquantized target verifies, so the
output is exactly the target's. The copy is built once per target (and, for presets, cached on
disk); an adaptive draft length follows the measured cost curve (see cost_length.py).
"""

from __future__ import annotations

from sparrow.cached_model import CachedModel
from sparrow.drafters.cost_length import follow_cost_curve
from sparrow.drafters.draft_model import DraftModelDrafter
from sparrow.models import LoadedModel
from sparrow.quantization import DEFAULT_GROUP_SIZE, quantized_copy

DEFAULT_BITS = "int4"


def build_quantized_self(target: LoadedModel, draft: None, num_draft_tokens: int, adaptive: bool,
                         bits: str | int | None = None, group_size: int = DEFAULT_GROUP_SIZE) -> DraftModelDrafter:
    """Registry builder for "quantized-self"; `bits` is int4 (default) or int8."""
    if getattr(target.model, "sparrow_quantization", None) is not None:
        raise ValueError("drafter 'quantized-self' needs an unquantized target (drop --quant, or use another drafter)")
    quantized = quantized_copy(target, DEFAULT_BITS if bits is None else bits, group_size, keep_dense=True)
    runner = CachedModel(target.model)
    drafter = DraftModelDrafter(CachedModel(quantized.model), runner.vocab_size, num_draft_tokens=num_draft_tokens,
                                adaptive=adaptive)
    drafter.name = "quantized-self"
    follow_cost_curve(drafter, runner)
    return drafter
