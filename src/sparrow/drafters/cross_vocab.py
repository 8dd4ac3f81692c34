"""Cross-vocabulary drafting (TokenTiming, arXiv 2510.15545): any small model drafts for any target.

One round:

1. Sync. The target tokens committed since the last round are brought into the draft's
   vocabulary: the draft's own tokens from last round are kept while their bytes match the
   committed text; the rest becomes the draft token with exactly those bytes when the draft's
   vocabulary has one, else a re-encoding in context (`TokenBytes.continuation`, a short
   look-behind window). The draft's KV cache is then cut back lazily to the longest prefix of
   draft tokens still valid: the prompt is never re-prefilled.
2. Draft. Up to `k` greedy steps in the draft's vocabulary; the length policy (sparrow.policy)
   picks `k` from the engine-measured draft and verify costs and the acceptance (k = 0: an empty
   draft, i.e. a plain decoding step, so a drafter that does not pay costs almost nothing).
3. Re-encode. The draft's bytes that continue the committed text are re-encoded with the target
   tokenizer in context; tokens straddling the end of the committed text are never proposed. The
   last target token is dropped unless the draft's text ended there (at a special token): more
   draft text could still change how it is cut (` hel` -> ` hello`).
4. Align. DTW between the draft's and the target's token strings (`dtw.py`) carries each draft
   token's confidence (its top probability) to the target tokens made from it; the proposal stops
   before the first target token whose carried confidence is under `min_confidence`.

Everything is computed in bytes (`TokenBytes`), so special tokens, a BOS the draft needs and the
target does not, byte-fallback tokens and characters split across tokens keep both sides exact.

Lossless: the proposal is a deterministic function of the context (argmax drafting, then
re-encoding), so `Draft.probs` is None and the rejection verifier applies the q = 1 rule:
accept x with probability p(x), else sample p with x removed; the emitted token follows p for
greedy and sampled decoding alike. (TokenTiming's fork verifies with `q.max()`, which is only
right for such one-hot q; sparrow never mixes the two cases.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from sparrow.config import SamplingConfig
from sparrow.drafters.base import DrafterBase
from sparrow.drafters.dtw import carry_confidence, dtw_path, target_to_source
from sparrow.drafters.token_bytes import TokenBytes, valid_utf8_prefix
from sparrow.errors import UserError
from sparrow.noise import Randomness
from sparrow.policy.length import LengthPolicy
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.runner import runner_for
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict

if TYPE_CHECKING:
    from sparrow.models import LoadedModel


@dataclass(frozen=True)
class CrossVocabConfig:
    num_draft_tokens: int = 8
    """Most draft-model steps per round."""
    adaptive: bool = False
    """The adaptive length policy: stop drafting under a confidence threshold, adapt the round cap."""
    backoff: bool | None = None
    """Draft 0 steps while drafting is measured not to pay (None: when adaptive)."""
    lookbehind: int = 8
    """Tokens of context re-encoded with new text, so new tokens are cut as in context."""
    window: int = 32
    """DTW band half-width (widened to the length gap)."""
    min_confidence: float = 0.05
    """Target tokens whose carried draft confidence is lower are not proposed (nor what follows);
    drafting stops after the first draft token under it."""

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UserError(f"k (num_draft_tokens) must be an integer >= 1, got {self.num_draft_tokens!r}")
        if self.lookbehind < 1 or self.window < 1:
            raise UserError(f"lookbehind and window must be >= 1, got {self.lookbehind}, {self.window}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise UserError(f"min_confidence must lie in [0, 1], got {self.min_confidence}")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class CrossVocabDrafter(DrafterBase):
    hidden_layers: tuple[int, ...] = ()  # reads no target hidden states
    name = "cross-vocab"

    def __init__(self, draft: CachedModel, target_tokenizer: PreTrainedTokenizerBase,
                 draft_tokenizer: PreTrainedTokenizerBase, config: CrossVocabConfig | None = None) -> None:
        self.draft = draft
        self.config = config or CrossVocabConfig()
        self.target_vocab = TokenBytes(target_tokenizer)
        self.draft_vocab = TokenBytes(draft_tokenizer)
        backoff = self.config.adaptive if self.config.backoff is None else self.config.backoff
        self.length = LengthPolicy(self.config.num_draft_tokens, adaptive=self.config.adaptive, backoff=backoff)
        # Special tokens the target knows by content: a draft that ends on one of them (<|im_end|>)
        # proposes it; any other draft special token ends the draft text.
        self._target_special = {self.target_vocab.pieces[i] for i in self.target_vocab.special} - {b""}
        self._start([])

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.draft.model,)

    def shared(self) -> tuple[object, ...]:
        return (self.target_vocab, self.draft_vocab)  # read-only tables over the two tokenizers

    # --- state ---------------------------------------------------------------------------------
    def _start(self, committed: list[int]) -> None:
        """Bring the whole of `committed` into the draft's vocabulary and prefill the draft with it."""
        self._committed = list(committed)  # target tokens seen so far
        self._content = bytearray(self.target_vocab.join(self._committed))  # their bytes
        tokenizer = self.draft_vocab.tokenizer
        start = [tokenizer.bos_token_id] if self.draft_vocab.adds_bos else []
        self._draft_ids: list[int] = start  # draft tokens standing for self._content[:self._synced]
        self._synced = 0
        self._generated: list[int] = []  # draft tokens proposed after self._draft_ids last round
        self._bring_over()
        if not self._draft_ids:  # nothing to condition on: start from the draft's own BOS or EOS
            self._draft_ids = [next(t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id, 0) if t is not None)]
        # The cache holds all but the last draft token, which the first round feeds (with what the target added):
        # no round rewinds into the prefilled prompt (a sliding-window layer cannot give a full window back).
        held = self._draft_ids[:-1] or self._draft_ids
        self._cached = list(held)  # draft tokens whose KV the draft cache holds
        if committed:
            self.draft.prefill(Prompt(input_ids=torch.tensor(held, dtype=torch.long)))

    def _bring_over(self) -> None:
        """Extend the draft tokens over the committed bytes they do not cover yet."""
        pending = bytes(self._content[self._synced:])
        for token in self._generated:  # 1. the draft's own tokens, while the target agreed with them
            piece = self.draft_vocab.pieces[token]
            if not pending.startswith(piece) or token in self.draft_vocab.special:
                break
            self._draft_ids.append(token)
            self._synced += len(piece)
            pending = pending[len(piece):]
        self._generated = []
        while pending:  # 2. the exact draft token, else a re-encoding in context
            exact = self.draft_vocab.by_bytes.get(pending)
            if exact is not None:
                ids, covered = [exact], len(pending)
            else:
                ids, covered = self.draft_vocab.continuation(self._draft_ids, pending, self.config.lookbehind)
            if covered == 0:
                if len(pending) < 4:
                    break  # an incomplete character: wait for its last bytes
                text = valid_utf8_prefix(pending)
                if text:  # the draft tokenizer changes this text (e.g. a space after special tokens):
                    ids, covered = self.draft_vocab.encode(text.decode("utf-8")), len(text)  # close enough
                else:  # a broken byte: its own token, if any
                    byte = self.draft_vocab.by_bytes.get(pending[:1])
                    ids, covered = ([] if byte is None else [byte]), 1
            self._draft_ids += ids
            self._synced += covered
            pending = pending[covered:]

    # --- Drafter protocol ----------------------------------------------------------------------
    def prefill(self, prompt: Prompt, target: CachedModel | None = None, out: TargetOutput | None = None) -> None:
        self.length.reset()
        self._start(prompt.input_ids.tolist())

    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                generator: Randomness) -> Draft:
        ids = committed.tolist()
        if ids[: len(self._committed)] != self._committed:  # not a continuation: start over
            self._start(ids)
        else:
            self._content += self.target_vocab.join(ids[len(self._committed):])
            self._committed = ids
            self._bring_over()
        steps = self.length.cap(self.config.num_draft_tokens if max_tokens >= 1 else 0)  # draft steps, not tokens
        tokens: list[int] = []
        if steps >= 1:
            generated, confidence = self._generate(steps)
            tokens = self._to_target(generated, confidence)[:max_tokens]
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long, device=self.draft.device))

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput, step: StepStats) -> None:
        self.length.observe(step)

    # --- one round -----------------------------------------------------------------------------
    def _generate(self, steps: int) -> tuple[list[int], list[float]]:
        """Up to `steps` greedy draft tokens after self._draft_ids, with their top probabilities."""
        valid = min(_common_prefix(self._cached, self._draft_ids), len(self._draft_ids) - 1)
        self.draft.rewind(valid)
        feed = self._draft_ids[valid:]
        generated, confidence = [], []
        for _ in range(steps):
            logits = self.draft.forward(torch.tensor(feed, dtype=torch.long, device=self.draft.device)).logits[-1]
            probs = logits[: len(self.draft_vocab)].float().softmax(-1)  # padded rows are no tokens
            top, token = probs.max(-1)
            generated.append(int(token))
            confidence.append(float(top))
            if (generated[-1] in self.draft_vocab.special or confidence[-1] < self.config.min_confidence
                    or not self.length.keep_drafting(confidence[-1])):
                break
            feed = generated[-1:]
        self._cached = self._draft_ids + generated[:-1]  # the last draft token was never fed
        self._generated = generated
        return generated, confidence

    def _to_target(self, generated: list[int], confidence: list[float]) -> list[int]:
        """Target tokens for the draft's text after the committed text (see the module docstring)."""
        pieces = [self.draft_vocab.pieces[t] for t in generated]
        complete = bool(generated) and generated[-1] in self.draft_vocab.special
        if complete and pieces[-1] not in self._target_special:
            pieces = pieces[:-1]  # a special token the target does not know ends the text
        text = b"".join(pieces)
        behind = bytes(self._content[self._synced:])  # committed bytes the draft tokens do not cover
        if not text.startswith(behind):
            return []
        text = text[len(behind):]
        tokens, covered = self.target_vocab.continuation(self._committed, text, self.config.lookbehind)
        if not (complete and covered == len(text)):
            tokens = tokens[:-1]  # more draft text could still change the last token
        if tokens and self.config.min_confidence > 0:
            mapping = target_to_source(dtw_path(self.draft_vocab.text(generated[: len(pieces)]),
                                                self.target_vocab.text(tokens), self.config.window), len(tokens))
            carried = carry_confidence(confidence, mapping)
            keep = next((j for j, c in enumerate(carried) if c < self.config.min_confidence), len(tokens))
            tokens = tokens[:keep]
        return tokens


def build(target: LoadedModel, draft: LoadedModel, num_draft_tokens: int, adaptive: bool,
          **options: Any) -> CrossVocabDrafter:
    """Registry entry point: `--drafter cross-vocab --draft M`."""
    config = CrossVocabConfig(num_draft_tokens=num_draft_tokens, adaptive=adaptive, **options)
    return CrossVocabDrafter(runner_for(draft.model), target.tokenizer, draft.tokenizer, config)
