"""Structured output: a grammar (a JSON schema, any JSON object, a regex) that every generated token keeps to.

Semantics: constrained decoding samples each token from the target's distribution masked by the grammar at that
position and renormalised (logits of forbidden tokens set to -inf before temperature / top-k / top-p); EOS is
allowed only where the grammar accepts the text so far. Speculation stays lossless relative to that:

* `Constraint.restrict` walks the draft before the target scores it, with the grammar state after the committed
  tokens: a chain stops at its first token the grammar forbids (deterministic drafts drop it: it could never be
  accepted, the q = 1 rule gives it probability p(x) = 0; sampled drafts keep it as the last node, rejected for
  certain, so the recovered token still comes from the residual norm(max(p - q, 0)) that rejection sampling
  needs), and at a stop token (kept: nothing follows it). A tree loses each forbidden node with its subtree.
  The walk yields the mask of every scored row: row 0 after the committed tokens, row i + 1 after the path to
  node i, so greedy verification takes the masked argmax and rejection sampling the masked distribution.
* Forced tokens: where the grammar allows exactly one token, the chain is extended with it up to the draft budget
  (rare with byte-level BPE vocabularies: most forced text can be spelled with several tokens). The masked
  distribution there is a point mass, so the verifier accepts it with certainty (greedy: it is the argmax;
  rejection: p(x) = 1; seeded: the only token the sample can pick) and it costs one more row of the round's
  target forward, not a forward of its own. Sampled drafts get a one-hot q row for it (q(x) = 1 = p(x)).
* Draft-model and layer-skip chains draft inside the grammar (`guiding`, `push` / `pop`): their draft logits are masked
with the
  state after the tokens drafted so far, so drafts are not cut at all; other drafters propose freely and are cut.
* The grammar state advances only over committed tokens (`commit`); the walk over a draft rolls the matcher
  back to the committed state when it is done (llguidance's `rollback`), for chains and for tree branches alike.
  A token is fed to the matcher only where its mask allows it (a refused token would leave it in an error state).

Engine: llguidance, picked by `benchmarks/grammar_engines.py` on correctness first, then CPU cost per token
(docs/results/structured.md): it enforces nested objects, enums, arrays, numeric bounds and regexes, and keeps
JSON strings free of raw control characters; xgrammar is cheaper per token (5-13 us against 12-200 us at 49k and
152k vocabularies) but lets a string with minLength / maxLength hold raw control characters (invalid JSON);
outlines-core ignores numeric bounds and costs 0.7-2 ms per token. Either cost is far below a target forward.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from sparrow.errors import UserError
from sparrow.types import Draft

WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
"""Whitespace a JSON grammar allows between tokens: a run of at most 16 (indentation; unbounded runs let a weak
model pad forever)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: `kind` "json" (source: a JSON schema, as canonical JSON text)
    or "regex" (source: the pattern)."""

    kind: str
    source: str

    @staticmethod
    def of(json_schema: object = None, regex: object = None) -> GrammarSpec | None:
        """The spec of the `json_schema=` / `regex=` options (None: unconstrained). json_schema: a dict, or its
        JSON text; {"type": "object"} is any JSON object (OpenAI's json_object)."""
        if json_schema is not None and regex is not None:
            raise UserError("json_schema and regex exclude each other: pass one", field="json_schema")
        if regex is not None:
            if not isinstance(regex, str) or not regex:
                raise UserError(f"regex must be a non-empty str, got {regex!r}", field="regex")
            return GrammarSpec("regex", regex)
        if json_schema is None:
            return None
        if isinstance(json_schema, (str, bytes)):
            try:
                json_schema = json.loads(json_schema)
            except ValueError as e:
                raise UserError(f"json_schema is not valid JSON: {e}", field="json_schema") from None
        if isinstance(json_schema, bool) or not isinstance(json_schema, Mapping):
            raise UserError(f"json_schema must be a JSON object (a dict), got {type(json_schema).__name__}",
                            field="json_schema")
        return GrammarSpec("json", json.dumps(json_schema))  # key order kept: it is the order of the output


class Constraint(Protocol):
    """A generation's grammar state over its committed tokens (see the module doc)."""

    def allowed(self) -> Tensor | None:
        """[vocab] bool: the tokens the grammar allows next; None: all."""

    def restrict(self, draft: Draft, budget: int) -> tuple[Draft, Tensor | None]:
        """The draft cut to what the grammar allows (and extended with forced tokens, at most `budget` nodes in
        all), and [len + 1, vocab] bool masks of its scored rows; None: no constraint."""

    def commit(self, tokens: Iterable[int]) -> None:
        """Advance over tokens the verifier committed."""

    def push(self, token: Tensor) -> bool:
        """Drafting: advance over a draft token ([1] or 0-dim) the current mask allows; False (nothing consumed)
        where nothing can follow it (a stop token). Undo with `pop`."""

    def pop(self, n: int) -> None:
        """Drafting: undo the last n pushes."""


class Free:
    """No grammar: drafts pass unchanged and nothing is masked."""

    seconds = 0.0

    def allowed(self) -> Tensor | None:
        return None

    def restrict(self, draft: Draft, budget: int) -> tuple[Draft, Tensor | None]:
        return draft, None

    def commit(self, tokens: Iterable[int]) -> None:
        pass

    def push(self, token: Tensor) -> bool:
        return True  # no host sync

    def pop(self, n: int) -> None:
        pass


FREE = Free()


class Guided(Protocol):
    """What `guiding` sets: a drafter's `grammar` (`sparrow.drafters.base.Drafter.grammar`)."""

    grammar: Constraint


@contextmanager
def guiding(drafter: Guided, grammar: Constraint) -> Iterator[None]:
    """A drafter that follows its `grammar` (draft-model and layer-skip chains) drafts only what `grammar` allows
    while inside:
    its draft logits are masked as the target's are, so drafts are not cut at the grammar. Lossless either way:
    a draft token is the argmax of the masked draft logits (q = 1 rule), or sampled from the masked q it
    reports. Drafters that ignore it are cut at the grammar by the engine."""
    drafter.grammar = grammar
    try:
        yield
    finally:
        drafter.grammar = FREE


def masked(logits: Tensor, allowed: Tensor | None) -> Tensor:
    """logits [..., vocab] with the tokens `allowed` ([..., vocab] bool) forbids at -inf (unchanged for None)."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


class Grammars:
    """Grammar compilation for one tokenizer (llguidance's view of its vocabulary, made once: seconds for a
    150k vocabulary); a pipeline keeps one. vocab_size: the model's logits width (may exceed the tokenizer's)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._ll, self._torch = llguidance, llguidance.torch
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._views: dict[tuple[int, ...], Any] = {}  # stop ids -> llguidance tokenizer

    def _view(self, stops: tuple[int, ...]) -> Any:
        if stops not in self._views:
            self._views[stops] = self._ll.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                            eos_token=list(stops))
        return self._views[stops]

    def grammar(self, spec: GrammarSpec) -> str:
        """llguidance's grammar text of the spec; an invalid schema is a UserError naming what is wrong."""
        if spec.kind == "regex":
            return self._ll.LLMatcher.grammar_from_regex(spec.source)
        options = {"whitespace_pattern": WHITESPACE}
        try:
            return self._ll.LLMatcher.grammar_from_json_schema(spec.source, defaults=options)
        except (ValueError, RuntimeError) as e:
            raise UserError(f"json_schema cannot be compiled: {one_line(e)}", field="json_schema") from None

    def start(self, spec: GrammarSpec, stop_ids: Iterable[int]) -> GrammarConstraint:
        """A fresh constraint for one generation; `stop_ids` end it (allowed where the grammar accepts)."""
        stops = tuple(sorted({int(i) for i in stop_ids}))
        if not stops:
            raise UserError("structured output (json_schema / regex) needs an end-of-sequence token, and the "
                            "model has none", field="json_schema" if spec.kind == "json" else "regex")
        what = "json_schema" if spec.kind == "json" else "regex"
        try:
            matcher = self._ll.LLMatcher(self._view(stops), self.grammar(spec), log_level=0)
        except (ValueError, RuntimeError) as e:
            raise UserError(f"{what} cannot be compiled: {one_line(e)}", field=what) from None
        if matcher.is_error():
            raise UserError(f"{what} cannot be compiled: {one_line(matcher.get_error())}", field=what)
        constraint = GrammarConstraint(matcher, self._torch, self.vocab_size, stops)
        if not bool(constraint.raw_mask().any()):
            raise UserError(f"the {what} allows no output at all", field=what)
        return constraint


def one_line(error: object) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__


class GrammarConstraint:
    """One generation's grammar state: an llguidance LLMatcher over the committed tokens (stop tokens are never
    fed to it: they end the output)."""

    def __init__(self, matcher: Any, ll_torch: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self.matcher, self._lt, self.vocab_size = matcher, ll_torch, vocab_size
        self.stop_ids = frozenset(stop_ids)
        self._stops = torch.tensor(stop_ids, dtype=torch.long)
        self._bitmask = ll_torch.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
        self._bits = torch.arange(32, dtype=torch.int32)
        self.ended = False  # a stop token was committed
        self.seconds = 0.0  # CPU seconds of this thread in the grammar (masks, walks, commits): its work
        self.forced = 0  # forced tokens added to drafts

    def allowed(self) -> Tensor:
        """[vocab] bool mask of the matcher's current state. A state with no way on (an unsatisfiable branch of
        the grammar) allows the stop tokens, so the output ends there instead of sampling from nothing."""
        start = time.thread_time()
        if self.ended:
            mask = torch.ones(self.vocab_size, dtype=torch.bool)
        else:
            mask = self.raw_mask()
            if not bool(mask.any()):
                mask[self._stops] = True
        self.seconds += time.thread_time() - start
        return mask

    def raw_mask(self) -> Tensor:
        """[vocab] bool: llguidance's mask of the current state (stop tokens where the grammar accepts)."""
        self._lt.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        words = self._bitmask[0]  # [ceil(vocab / 32)]: bit j of word w is token 32 w + j
        return ((words[:, None] >> self._bits) & 1).bool().reshape(-1)[: self.vocab_size]

    def commit(self, tokens: Iterable[int]) -> None:
        start = time.thread_time()
        for token in tokens:
            if self.ended or int(token) in self.stop_ids:
                self.ended = True
                break
            ok = self.matcher.consume_token(int(token))
            assert ok, f"the verifier committed token {token}, which the grammar forbids: {self.matcher.get_error()}"
        self.seconds += time.thread_time() - start

    def push(self, token: Tensor) -> bool:
        token = int(token)
        if self.ended or token in self.stop_ids or self.matcher.validate_tokens([token]) != 1:
            return False
        return self._accept(token)

    def pop(self, n: int) -> None:
        self._rollback(n)

    def restrict(self, draft: Draft, budget: int) -> tuple[Draft, Tensor]:
        masks = [self.allowed()]
        if draft.is_tree:
            kept = self._walk_tree(draft, masks)
            return kept, torch.stack(masks)
        chain = self._walk_chain(draft, masks, budget)
        return chain, torch.stack(masks)

    def _accept(self, token: int) -> bool:
        """Consume a token the current mask allows (a forbidden one would leave the matcher in its error state)."""
        start = time.thread_time()
        ok = self.matcher.consume_token(token)
        self.seconds += time.thread_time() - start
        return ok

    def _rollback(self, n: int) -> None:
        if n:
            start = time.thread_time()
            self.matcher.rollback(n)
            self.seconds += time.thread_time() - start

    def _walk_chain(self, draft: Draft, masks: list[Tensor], budget: int) -> Draft:
        """Cut the chain at its first forbidden token (kept as a sure reject if sampled) or stop token, extend it
        with forced tokens; masks gets one row per node. The matcher ends where it started."""
        tokens = draft.tokens.tolist()
        sampled = draft.probs is not None
        consumed, n, ended = 0, 0, False
        for token in tokens:
            if not bool(masks[-1][token]):  # forbidden
                if sampled:  # p(token) = 0 after masking: rejected for certain, the residual follows
                    n += 1
                    masks.append(torch.ones_like(masks[-1]))
                ended = True
                break
            n += 1
            if token in self.stop_ids or not self._accept(token):
                masks.append(torch.ones_like(masks[-1]))  # the output ends here: the row is never read
                ended = True
                break
            consumed += 1
            masks.append(self.allowed())
        forced: list[int] = []
        while not ended and n + len(forced) < budget:
            only = masks[-1].nonzero()
            if only.numel() != 1 or int(only) in self.stop_ids or not self._accept(int(only)):
                break
            forced.append(int(only))
            self.forced += 1
            consumed += 1
            masks.append(self.allowed())
        self._rollback(consumed)
        if n == len(tokens) and not forced:
            return draft
        ids = torch.tensor(tokens[:n] + forced, dtype=torch.long, device=draft.tokens.device)
        probs = None
        if sampled:
            assert draft.probs is not None
            one_hot = torch.nn.functional.one_hot(torch.tensor(forced, dtype=torch.long),
                                                  draft.probs.shape[-1]).to(draft.probs)
            probs = torch.cat([draft.probs[:n], one_hot.to(draft.probs.device)])
        return Draft(tokens=ids, probs=probs, parents=None if draft.parents is None else
                     torch.arange(-1, len(ids) - 1, device=draft.parents.device))

    def _walk_tree(self, draft: Draft, masks: list[Tensor]) -> Draft:
        """Drop each node the grammar forbids after its path (kept as a sure-reject leaf if sampled) with its
        subtree; nodes after a stop token are dropped. masks gets one row per kept node."""
        assert draft.parents is not None
        tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
        sampled = draft.probs is not None
        new_index: dict[int, int] = {}  # old node -> kept node
        open_: set[int] = set()  # kept nodes that may have children (accepted by the grammar, not a stop)
        path: list[int] = []  # old nodes the matcher has consumed, root to leaf
        kept: list[int] = []
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            if parent != -1 and parent not in open_:
                continue
            want = self._path(parent, parents)
            common = next((j for j, (a, b) in enumerate(zip(path, want)) if a != b), min(len(path), len(want)))
            self._rollback(len(path) - common)
            for node in want[common:]:
                ok = self._accept(tokens[node])
                assert ok
            path = want
            row = masks[0] if parent == -1 else masks[new_index[parent] + 1]
            if not bool(row[token]) and not sampled:
                continue
            new_index[i] = len(kept)
            kept.append(i)
            if bool(row[token]) and token not in self.stop_ids and self._accept(token):
                masks.append(self.allowed())
                self._rollback(1)
                open_.add(i)
            else:  # a sure reject (sampled, forbidden) or a stop token: a leaf whose row is never read
                masks.append(torch.ones_like(masks[0]))
        self._rollback(len(path))
        if len(kept) == len(tokens):
            return draft
        index = torch.tensor(kept, dtype=torch.long)
        new_parents = torch.tensor([-1 if parents[i] == -1 else new_index[parents[i]] for i in kept],
                                   dtype=torch.long, device=draft.parents.device)
        return Draft(tokens=draft.tokens[index.to(draft.tokens.device)],
                     probs=None if draft.probs is None else draft.probs[index.to(draft.probs.device)],
                     parents=new_parents)

    @staticmethod
    def _path(node: int, parents: list[int]) -> list[int]:
        """Old node indices from the root's child down to `node` (empty for the root, -1)."""
        path = []
        while node != -1:
            path.append(node)
            node = parents[node]
        return path[::-1]
