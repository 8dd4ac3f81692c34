"""Auto drafter: per round, the drafting method with the highest measured tokens per second, or none.

Candidates are ordinary drafters: prompt lookup, the draft model when one is given (cross-vocab
when its vocabulary differs from the target's), self-drafts (layer-skip when it is registered
and tuned for the target; quantized-self on request, since it builds an int4 copy of the target),
and suffix decoding (model-free, from the request's text and earlier outputs; free to ask, like prompt lookup).
"none" (an empty draft, i.e. a plain decoding step) is always an option.

Each option's throughput is estimated online from what its rounds cost and yielded:

    rate(c)    = sum tokens / (sum draft seconds + sum verify_seconds(k + 1))   (exponentially forgotten)
    rate(none) = 1 / verify_seconds(1)

with tokens = accepted drafts + the bonus token, and verify_seconds(n) = a + b n fitted to every
round's target forward (sparrow.policy.estimates.DecayedLine). Draft and verify seconds are the engine's own
measurements of the round (`StepStats`), less the cost of switching to a draft model: its lazy prefill
and its catch-up on the tokens committed while other options drafted (one forward, timed apart). Counted
in, a probe after 16 rounds without the draft paid for feeding it those tokens, measured the draft as
slower than plain decoding, and kept it out (a w8a8 1.5B target on code: 3 draft-model rounds in 106).

Policy, every round:
1. Prompt lookup costs almost nothing, so it proposes every round; so do the other candidates that are free to ask
   (suffix), in order, in the rounds where no earlier one's draft is used. When one finds a match and its
   rate is the best known one (or still unknown), its draft is used. (Probed like a model instead, suffix was asked
   only where prompt lookup had no match, i.e. where the last token never occurred in the context, so its own trie
   had nothing either: its probes drafted nothing, lost, and it was rarely asked again.)
2. Otherwise model-based candidates are probed (a couple of rounds each at first), then the
   option with the highest rate among them and "none" is used. A candidate that is not chosen is
   re-probed for one round `reprobe_interval` rounds after it was last used, the interval doubling
   (up to `max_reprobe_interval`) after each probe until it wins, so a useless draft costs only a
   round now and then, and speculation that does not pay turns into plain decoding. (This is the
   back-off, every policy's `sparrow.policy.estimates.BackOff` with one schedule per candidate; the
   candidates' own back-off is switched off.)
3. The free candidates' proposals that are not used are scored anyway once the committed tokens reach
   past them (a shadow verdict: the longest prefix equal to what was committed, which is exactly
   what greedy verification would have accepted), so its estimate follows the text for free.

Lossless whatever it picks: each round's Draft is the chosen candidate's own (argmax or n-gram
drafts with probs None, sampled drafts with their q), and the verifier does the rest. Candidates
with their own caches (draft model, cross-vocab) re-sync lazily from `committed` when they draft
again; they are prefilled lazily, on their first use in a request.

With sampling the choices depend on wall-clock time; a seeded request still repeats exactly, since its
tokens do not depend on what was drafted (`sparrow.noise`), while an unseeded one is only lossless.
`choices` records what each round used (for benchmarks and tests).
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sparrow.config import SamplingConfig
from sparrow.drafters.base import DrafterBase, DrafterInfo, distinct
from sparrow.drafters.registry import REGISTRY
from sparrow.drafters.vocab import DraftVocab, resolve_draft_vocab
from sparrow.errors import UserError
from sparrow.heads.layout import find_head, load_head
from sparrow.noise import Randomness
from sparrow.policy.estimates import BackOff, Decayed, DecayedLine
from sparrow.runtime.cached_model import CachedModel
from sparrow.timing import now
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict

if TYPE_CHECKING:
    from sparrow.drafters import Drafter
    from sparrow.models import LoadedModel

PLAIN = "none"


@dataclass(frozen=True)
class AutoRound:
    """What one round used and what it yielded."""

    choice: str  # a candidate's name, or "none" (a plain decoding step)
    drafted: int
    accepted: int


@dataclass(frozen=True)
class AutoConfig:
    forgetting: float = 0.8
    """Per-observation decay of an option's statistics, so its estimate follows the text."""
    probe_rounds: int = 2
    """Rounds a model-based candidate drafts before it is judged."""
    reprobe_interval: int = 8
    """Rounds before a candidate that is not chosen is tried again; doubles after each losing probe."""
    max_reprobe_interval: int = 64
    probe_weight: float = 0.2
    """Weight left to a candidate's old statistics when it is re-probed (the probe then counts most)."""
    carry_over: float = 0.5
    """Weight left to the statistics of earlier requests at prefill (costs carry over, the text does not)."""
    verify_decay: float = 0.97
    """Per-round decay of the verify-cost line (the machine changes more slowly than the text)."""

    def __post_init__(self) -> None:
        for name in ("forgetting", "probe_weight", "carry_over", "verify_decay"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UserError(f"AutoConfig.{name} must lie in [0, 1], got {getattr(self, name)!r}")
        if self.probe_rounds < 1 or self.reprobe_interval < 1 or self.max_reprobe_interval < self.reprobe_interval:
            raise UserError("AutoConfig needs probe_rounds >= 1 and 1 <= reprobe_interval <= max_reprobe_interval")


@dataclass
class Throughput:
    """An option's rounds, exponentially forgotten (`forgetting` per round)."""

    forgetting: float

    def __post_init__(self) -> None:
        self.rounds = Decayed(self.forgetting, (0.0,) * 4)  # (1, tokens yielded, draft seconds, draft tokens)
        self.count = 0  # observations ever (not forgotten)

    def add(self, tokens: int, draft_seconds: float, drafted: int) -> None:
        self.rounds.add(1.0, tokens, draft_seconds, drafted)
        self.count += 1

    def rate(self, verify: DecayedLine) -> float | None:
        """Tokens per second, or None before the first observation (verify(k + 1) = a + b + b k)."""
        rounds, tokens, draft_seconds, drafted = self.rounds.sums
        if rounds <= 0 or not verify.known:
            return None
        a, b = verify.line()
        return tokens / max(draft_seconds + (a + b) * rounds + b * drafted, 1e-12)


@dataclass
class _Shadow:
    """A free candidate's proposal that was not used, scored once the committed tokens reach past it."""

    name: str
    position: int  # committed length when proposed: the draft continues committed[position:]
    tokens: list[int]
    draft_seconds: float


class AutoDrafter(DrafterBase):
    hidden_layers: tuple[int, ...] = ()  # reads no target hidden states
    name = "auto"

    def __init__(self, candidates: Sequence[Drafter], config: AutoConfig | None = None) -> None:
        """candidates: drafters with distinct names ("none" is implicit)."""
        names = [c.name for c in candidates]
        if len(set(names)) != len(names) or PLAIN in names:
            raise UserError(f"auto drafter candidates need distinct names other than {PLAIN!r}, got {names}")
        self.config = config or AutoConfig()
        self.candidates: dict[str, Drafter] = {c.name: c for c in candidates}
        # Candidates that read the target's hidden states (an eagle head) follow every round's committed rows,
        # chosen or not; the target then returns the hidden states they read (one set of layers).
        self.followers = [n for n, c in self.candidates.items() if c.hidden_layers]
        layers = {tuple(self.candidates[n].hidden_layers) for n in self.followers}
        if len(layers) > 1:
            raise UserError(f"auto drafter candidates read different target layers {sorted(layers)}: give one")
        self.hidden_layers: tuple[int, ...] = layers.pop() if layers else ()
        infos = {c.name: c.describe() for c in candidates}
        self.lookups = [n for n in names if infos[n].free_to_ask]  # asked every round, in this order
        self.models = [n for n in names if n not in self.lookups]  # candidates that cost real compute to probe
        for info in infos.values():  # plain rounds are this drafter's choice ("none"), not a candidate's
            if info.length is not None:
                info.length.backoff = False
            if info.tree_policy is not None:
                info.tree_policy.backoff = False
        self.verify = DecayedLine(self.config.verify_decay)
        self.stats = {n: Throughput(self.config.forgetting) for n in names}
        self.choices: list[str] = []  # what each round of the current request used
        self.rounds: list[AutoRound] = []  # the same, with what each round yielded
        self._probes = {n: BackOff(self.config.reprobe_interval, self.config.max_reprobe_interval)
                        for n in self.models}
        self._shadows: list[_Shadow] = []
        self._lazy: set[str] = set()
        self._prompt: Prompt | None = None
        self._target: CachedModel | None = None
        self._prefill_out: TargetOutput | None = None
        self._round = PLAIN  # this round's option
        self._switch_seconds = 0.0  # of this round's draft seconds: a lazy prefill and a catch-up (not drafting)

    # --- Drafter protocol ----------------------------------------------------------------------
    def modules(self) -> tuple[torch.nn.Module, ...]:
        return distinct(module for candidate in self.candidates.values() for module in candidate.modules())

    def shared(self) -> tuple[object, ...]:
        """Its candidates' shared objects, and the last generation's target runner (the fork's prefill replaces
        it)."""
        return distinct((*(obj for c in self.candidates.values() for obj in c.shared()), self._target))

    def fork(self) -> AutoDrafter:
        """A copy of its statistics and policy state over forks of its candidates (each sharing what it
        declares), sharing the last generation's target runner."""
        memo: dict[int, object] = {id(c): c.fork() for c in self.candidates.values()}
        memo.update((id(obj), obj) for obj in distinct((self._target,)))
        return copy.deepcopy(self, memo)

    def describe(self) -> DrafterInfo:
        """Its candidates, the rounds each option drafted in its last request, and whether a candidate watches the
        target's prefill."""
        candidates = tuple(self.candidates.values())
        return DrafterInfo(candidates=candidates, rounds_per_option=dict(Counter(self.choices)),
                           watches_prefill=any(c.describe().watches_prefill for c in candidates))

    @contextmanager
    def watch_prefill(self, target: CachedModel) -> Iterator[None]:
        """Every candidate's context around the target's prefill (e.g. a sparse candidate's query capture)."""
        with ExitStack() as stack:
            for candidate in self.candidates.values():
                stack.enter_context(candidate.watch_prefill(target))
            yield

    def prefill(self, prompt: Prompt, target: CachedModel, out: TargetOutput | None = None) -> None:
        self._prompt, self._target, self._prefill_out = prompt, target, out
        self.choices, self.rounds = [], []
        self._shadows = []
        for stats in self.stats.values():
            stats.rounds.scale(self.config.carry_over)
        for name in self.lookups:  # a lookup's worth is all in the text: start afresh (its first match is tried)
            self.stats[name] = Throughput(self.config.forgetting)
        for n, probes in self._probes.items():
            probes.restart(self.config.reprobe_interval if self.stats[n].count else 0)
        # Drafters with their own model prefill on first use; the rest (they may read the target's
        # fresh cache) now.
        self._lazy = {n for n, c in self.candidates.items() if c.describe().draft is not None}
        for name, candidate in self.candidates.items():
            if name not in self._lazy:
                candidate.prefill(prompt, target, out)

    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                generator: Randomness) -> Draft:
        self._switch_seconds = 0.0
        if max_tokens < 1:
            return self._chosen(PLAIN, Draft.empty(committed.device))
        self._score_shadows(committed)
        for name in self.lookups:
            asked = now(committed.device)
            lookup_draft = self.candidates[name].propose(committed, max_tokens, sampling, generator)
            if len(lookup_draft) and self._lookup_wins(name):
                return self._chosen(name, lookup_draft)
            if len(lookup_draft):
                seconds = now(committed.device) - asked
                self._shadows.append(_Shadow(name, committed.numel(), lookup_draft.tokens.tolist(), seconds))
        name, probe = self._pick_model()
        if name == PLAIN:
            return self._chosen(PLAIN, Draft.empty(committed.device))
        switch = now(committed.device)  # a lazy prefill and a catch-up are the cost of switching, not of drafting
        if name in self._lazy:
            self._lazy.discard(name)
            self.candidates[name].prefill(self._prompt, self._target, self._prefill_out)
        batching = self.candidates[name].batching
        if batching is not None:
            batching.catch_up(committed)
        self._switch_seconds = now(committed.device) - switch
        if probe:
            self.stats[name].rounds.scale(self.config.probe_weight)  # stale: let this round count most
        draft = self.candidates[name].propose(committed, max_tokens, sampling, generator)
        return self._chosen(name, draft)

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput, step: StepStats) -> None:
        self.verify.add(len(draft) + 1, step.verify_seconds)
        name = self._round
        self.rounds.append(AutoRound(name, len(draft), verdict.num_accepted))
        for follower in self.followers:
            if follower != name:
                self.candidates[follower].follow(out)
        if name == PLAIN:
            return
        step = replace(step, draft_seconds=max(step.draft_seconds - self._switch_seconds, 0.0))
        self.candidates[name].observe(draft, verdict, out, step)
        self.stats[name].add(verdict.num_accepted + 1, step.draft_seconds, len(draft))

    # --- policy --------------------------------------------------------------------------------
    def _options(self) -> list[str]:
        return [*self.models, PLAIN]

    def _rate(self, name: str) -> float | None:
        if name == PLAIN:
            return 1.0 / self.verify(1) if self.verify.known else None
        return self.stats[name].rate(self.verify)

    def _lookup_wins(self, name: str) -> bool:
        """Use this round's match of free candidate `name`? Yes unless a known option is measured to be faster."""
        mine = self._rate(name)
        if mine is None:
            return True
        others = [r for r in map(self._rate, self._options()) if r is not None]
        return mine >= max(others, default=0.0)

    def _pick_model(self) -> tuple[str, bool]:
        """(option, whether it is a probe) for a round without a free candidate's draft: the first rounds of each
        candidate, then the best option, or a candidate whose probe is due (the one waiting longest; one a round).
        A candidate in use pays (its back-off restarts); a probe is a step of one that does not."""
        step = len(self.choices)
        for name in self.models:
            if self.stats[name].count < self.config.probe_rounds:
                self._probes[name].decide(True, step)
                return name, False
        rates = {n: self._rate(n) for n in self._options()}
        best = max(rates, key=lambda n: -1.0 if rates[n] is None else rates[n])
        due = [n for n in self.models if n != best and self._probes[n].due(step)]
        if due:
            name = min(due, key=lambda n: self._probes[n].next)
            return name, self._probes[name].decide(False, step)
        if best in self._probes:
            self._probes[best].decide(True, step)
        return best, False

    def _chosen(self, name: str, draft: Draft) -> Draft:
        self.choices.append(name)
        self._round = name
        return draft

    def _score_shadows(self, committed: Tensor) -> None:
        """Score the free candidates' unused proposals whose outcome the committed tokens now decide."""
        if not self._shadows:
            return
        first = min(s.position for s in self._shadows)
        known = committed[first:].tolist()
        pending = []
        for shadow in self._shadows:
            actual = known[shadow.position - first:]
            accepted = 0
            while accepted < min(len(actual), len(shadow.tokens)) and actual[accepted] == shadow.tokens[accepted]:
                accepted += 1
            if accepted < len(actual):  # decided: a mismatch, or every token matched and the next is known
                drafted = len(shadow.tokens)
                self.stats[shadow.name].add(accepted + 1, shadow.draft_seconds, drafted)
                verdict = Verdict(tokens=torch.tensor(actual[: accepted + 1]), num_accepted=accepted)
                verify = self.verify(drafted + 1) if self.verify.known else 0.0  # modelled: never verified
                modelled = StepStats(drafted, accepted, shadow.draft_seconds, verify)
                self.candidates[shadow.name].observe(Draft(tokens=torch.tensor(shadow.tokens)), verdict, None, modelled)
            else:
                pending.append(shadow)
        self._shadows = pending


def build(target: LoadedModel, draft: LoadedModel | None, num_draft_tokens: int, adaptive: bool,
          quantized_self: bool = False, layer_skip: bool = True, config: AutoConfig | None = None,
          tree_budget: int | str = 0, tree_topk: int = 4, tree_depth: int = 8,
          draft_vocab: int | str | DraftVocab | None = None, suffix: bool = True, eagle: bool = True) -> AutoDrafter:
    """Registry builder for "auto". `num_draft_tokens` caps every candidate (each keeps its own default
    when that is lower). quantized_self: also try an int4 copy of the target (built now: memory and
    seconds). layer_skip: try "layer-skip" when it is registered and tuned for this target.
    tree_budget (> 0 or "auto"): the same-vocabulary draft model (and quantized-self) also run as tree
    drafters ("draft-model+tree"), so auto chooses between chain, tree and plain decoding.
    draft_vocab (N, "auto" or a DraftVocab): the candidates with a draft LM head (a same-vocabulary draft model,
    layer-skip, quantized-self) score only the N most frequent target tokens (FR-Spec).
    suffix: try "suffix" (Suffix Decoding: drafts from the request's text and the outputs auto saw before).
    eagle: try the eagle head shipped or trained for a preset target (`sparrow.heads.layout.find_head`), if any."""
    tree = {"tree_budget": tree_budget, "tree_topk": tree_topk, "tree_depth": tree_depth} if tree_budget else None
    vocab = resolve_draft_vocab(draft_vocab, target, CachedModel(target.model).vocab_size)  # once, shared
    heads = {"draft_vocab": vocab} if vocab is not None else {}
    def make(name: str, draft_model: LoadedModel | None, **options: Any) -> Drafter:
        entry = REGISTRY[name]
        default = entry.default_num_draft_tokens  # None: the builder's own choice (layer-skip: its tuned k)
        return entry.builder(target, draft_model, None if default is None else min(num_draft_tokens, default),
                             adaptive, **options)

    candidates = [make("prompt-lookup", None)]
    if draft is not None:
        same_vocab = CachedModel(draft.model).vocab_size == CachedModel(target.model).vocab_size
        candidates.append(make("draft-model", draft, **heads) if same_vocab else make("cross-vocab", draft))
        if same_vocab and tree:
            candidates.append(make("draft-model", draft, **tree, **heads))
    if layer_skip and "layer-skip" in REGISTRY:
        try:
            with warnings.catch_warnings():  # a set measured to lose comes back disabled: left out below
                warnings.simplefilter("ignore")
                skipper = make("layer-skip", None, **heads)
            if skipper.describe().enabled:
                candidates.append(skipper)
        except ValueError:  # no tuned skip set for this target (or a quantized target)
            pass
    if quantized_self:
        candidates.append(make("quantized-self", None, **heads))
        if tree:
            candidates.append(make("quantized-self", None, **tree, **heads))
    head = _available_head(target) if eagle else None
    if head is not None:
        candidates.append(make("eagle", None, head=head))
    if suffix and "suffix" in REGISTRY:
        candidates.append(make("suffix", None))
    return AutoDrafter(candidates, config=config)


def _available_head(target: LoadedModel) -> Any:
    """The eagle head shipped or trained for a preset target (`sparrow.heads.layout.find_head`), or None; a head
    that does not fit the target is left out with a warning."""
    head = find_head(target.name)
    if head is None:
        return None

    try:
        return load_head(head, target.model)
    except UserError as error:
        warnings.warn(f"auto: the eagle head {head} is left out ({error})", stacklevel=3)
        return None
