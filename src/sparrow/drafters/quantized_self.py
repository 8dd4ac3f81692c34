"""Quantized self-draft: the draft is a weight-only int4/int8 copy of the target itself.

The copy shares the target's tokenizer, vocabulary and (dense) embeddings and agrees with it on
almost every token, while a single-token forward reads 2-4x fewer weight bytes. It runs as an
ordinary draft model (own KV cache, lazy rollback) and the unquantized target verifies, so the
output is exactly the target's. The copy is built once per target (and, for presets, cached on
disk); an adaptive draft length follows the measured cost curve (see sparrow.policy).
"""

from __future__ import annotations

from sparrow.drafters.draft_model import DraftModelDrafter
from sparrow.drafters.tree_draft import resolve_shape
from sparrow.drafters.vocab import DraftVocab, resolve_draft_vocab
from sparrow.errors import UserError
from sparrow.models import LoadedModel
from sparrow.models.quantization import DEFAULT_GROUP_SIZE, LONG, quantized_copy
from sparrow.policy.measure import follow_cost_curve
from sparrow.runtime.runner import runner_for

DEFAULT_BITS = "int4"


def build_quantized_self(target: LoadedModel, draft: None, num_draft_tokens: int, adaptive: bool,
                         bits: str | int | None = None, group_size: int = DEFAULT_GROUP_SIZE,
                         tree_budget: int | str = 0, tree_topk: int = 4, tree_depth: int = 8,
                         draft_vocab: int | str | DraftVocab | None = None) -> DraftModelDrafter:
    """Registry builder for "quantized-self"; `bits` is int4 (default) or int8; tree and draft_vocab options
    as "draft-model"."""
    if getattr(target.model, "sparrow_quantization", None) is not None:
        raise UserError("drafter 'quantized-self' needs an unquantized target (drop --quant, or use another drafter)")
    quantized = quantized_copy(target, DEFAULT_BITS if bits is None else bits, group_size, dense=LONG)
    runner, draft_runner = runner_for(target.model), runner_for(quantized.model)
    shape = resolve_shape(tree_budget, tree_topk, tree_depth, runner)
    vocab = resolve_draft_vocab(draft_vocab, target, runner.vocab_size)
    drafter = DraftModelDrafter(draft_runner, runner.vocab_size, num_draft_tokens=num_draft_tokens,
                                adaptive=adaptive, tree=shape, name="quantized-self", vocab=vocab)
    follow_cost_curve(drafter, runner)
    return drafter
