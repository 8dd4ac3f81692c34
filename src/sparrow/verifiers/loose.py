"""Loose verification (LVSpec-style): LOSSY by design, opt-in only, never chosen by "auto".

Draft tokens are split into *anchors* (verified strictly: must equal the target's own choice) and
*fillers* (verified loosely). LVSpec's code is not public; this is our reading of the paper:

* filler: a token whose text is whitespace, punctuation or an English function word (a filler mask
  built from the tokenizer, `filler_mask`), i.e. a token that carries no visual fact. Without a
  tokenizer every token counts as an anchor except where the target itself is undecided
  (top-1 probability < `anchor_confidence`): a confident target position is treated as a fact.
* loose rule for fillers: accept draft token x at row i if x is among the target's `top_m` tokens
  there and p(x) >= `min_ratio` * max p (the target finds it almost as good as its own choice).
* position-shift tolerance: a filler that fails the loose rule is still accepted when it equals the
  target's choice at a neighbouring row (|j - i| <= `shift_window`): the target would say the same
  word one position earlier or later.
* the first rejected token is replaced by the target's choice (argmax at T = 0, a sample from p
  otherwise); a fully accepted draft gets the target's bonus token.

The output is NOT the target's output; measure the cost with `fidelity(...)` against strict decoding.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.errors import UserError
from sparrow.noise import Randomness, at
from sparrow.types import Draft, Verdict

FUNCTION_WORDS = frozenset("""
a an the and or but nor so yet of in on at to for from by with without into onto over under about above below
between among through during before after as than then that this these those there here it its it's is are was
were be been being has have had do does did can could will would shall should may might must very also just
which who whom whose what when where while how some any each every both either neither such own same other
""".split())


def is_filler_text(text: str) -> bool:
    """Whitespace, punctuation or a function word (case-insensitive); anything else may be a visual fact."""
    word = text.strip().lower()
    return not word or all(c in string.punctuation for c in word) or word in FUNCTION_WORDS


@lru_cache(maxsize=8)
def _filler_ids(tokenizer) -> tuple[int, ...]:
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    special = set(tokenizer.all_special_ids)
    return tuple(i for i, t in enumerate(texts) if i not in special and is_filler_text(t))


def filler_mask(tokenizer, vocab_size: int) -> Tensor:
    """[vocab_size] bool: True for filler tokens (see `is_filler_text`); special tokens are anchors."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    ids = [i for i in _filler_ids(tokenizer) if i < vocab_size]
    mask[ids] = True
    return mask


class LooseVerifier:
    """Lossy verifier: anchors strictly, fillers within the target's top-m / probability ratio."""

    name = "loose"
    lossy = True

    def __init__(self, filler_mask: Tensor | None = None, top_m: int = 3, min_ratio: float = 0.3,
                 shift_window: int = 1, anchor_confidence: float = 0.5) -> None:
        if isinstance(top_m, bool) or not isinstance(top_m, int) or top_m < 1:
            raise UserError(f"top_m must be an integer >= 1, got {top_m!r}")
        if not 0.0 <= min_ratio <= 1.0:
            raise UserError(f"min_ratio must lie in [0, 1], got {min_ratio!r}")
        if isinstance(shift_window, bool) or not isinstance(shift_window, int) or shift_window < 0:
            raise UserError(f"shift_window must be an integer >= 0, got {shift_window!r}")
        if not 0.0 <= anchor_confidence <= 1.0:
            raise UserError(f"anchor_confidence must lie in [0, 1], got {anchor_confidence!r}")
        if filler_mask is not None and (filler_mask.ndim != 1 or filler_mask.dtype != torch.bool):
            raise UserError("filler_mask must be a 1-D bool tensor over the vocabulary")
        self.filler_mask = filler_mask
        self.top_m, self.min_ratio, self.shift_window = top_m, min_ratio, shift_window
        self.anchor_confidence = anchor_confidence

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, **options) -> LooseVerifier:
        return cls(filler_mask=filler_mask(tokenizer, vocab_size), **options)

    def fillers(self, tokens: Tensor, p: Tensor) -> Tensor:
        """[k] bool: which draft tokens may be verified loosely (p: [k, vocab] target probabilities)."""
        if self.filler_mask is not None:
            mask = self.filler_mask.to(tokens.device)
            inside = tokens < mask.numel()
            return inside & mask[tokens.clamp_max(mask.numel() - 1)]
        return p.max(-1).values < self.anchor_confidence

    def verify(
        self,
        draft: Draft,
        target_logits: Tensor,  # [k + 1, vocab]
        sampling: SamplingConfig,
        generator: Randomness,  # positional noise: offset 0 is the position of the first draft token
    ) -> Verdict:
        k = len(draft)
        assert target_logits.ndim == 2 and target_logits.shape[0] == k + 1, (tuple(target_logits.shape), k)
        tokens = draft.tokens.to(target_logits.device)
        # Loose decisions are made on the plain (temperature-free) target distribution.
        p = target_logits.float().softmax(-1)  # [k + 1, vocab]
        choice = p.argmax(-1)  # [k + 1]
        strict = tokens == choice[:k]
        p_x = p[:k].gather(1, tokens[:, None])[:, 0]
        top = p[:k].topk(min(self.top_m, p.shape[-1]), dim=-1).indices  # [k, m]
        loose = (top == tokens[:, None]).any(-1) & (p_x >= self.min_ratio * p[:k].max(-1).values)
        shifted = torch.zeros_like(strict)
        for d in range(1, self.shift_window + 1):  # the target says x one row earlier / later
            shifted[d:] |= tokens[d:] == choice[: k - d]
            shifted[: k - d] |= tokens[: k - d] == choice[d:k]
        ok = strict | (self.fillers(tokens, p[:k]) & (loose | shifted))
        bad = (~ok).nonzero()
        n = int(bad[0]) if bad.numel() else k
        last = S.choose(target_logits[n], sampling, at(generator, n)).reshape(1).to(tokens.device)
        return Verdict(tokens=torch.cat([tokens[:n], last]), num_accepted=n)


@dataclass(frozen=True)
class Fidelity:
    """How close lossy outputs stay to strict (lossless) decoding of the same prompts."""

    identical: float  # share of outputs identical token for token
    token_agreement: float  # share of positions with the same token (over the longer output), pooled
    prefix_agreement: float  # mean share of the strict output reproduced before the first difference
    samples: int

    def to_dict(self) -> dict[str, float | int]:
        return {"identical": self.identical, "token_agreement": self.token_agreement,
                "prefix_agreement": self.prefix_agreement, "samples": self.samples}


def fidelity(outputs: list[list[int]], strict: list[list[int]]) -> Fidelity:
    """Compare lossy `outputs` with `strict` outputs of the same prompts (same order)."""
    if len(outputs) != len(strict):
        raise UserError(f"outputs and strict must have the same length, got {len(outputs)} and {len(strict)}")
    if not outputs:
        raise UserError("fidelity needs at least one output")
    same = agree = total = 0
    prefix = 0.0
    for a, b in zip(outputs, strict):
        same += a == b
        agree += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += first / len(b) if b else float(not a)
    return Fidelity(identical=same / len(outputs), token_agreement=agree / total if total else 1.0,
                    prefix_agreement=prefix / len(outputs), samples=len(outputs))
