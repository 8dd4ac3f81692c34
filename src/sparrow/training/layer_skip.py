"""`sparrow tune layer-skip`: find the layer-skip set with the highest expected speed on this machine.

Objective. A draft that agrees with the target with probability `a` per token (greedy acceptance)
and costs `c` target decode steps per token gives, for k drafted tokens per round,

    speedup(k) = E(a, k) * T(1) / (k * c * T(1) + T(k + 1)),     E(a, k) = (1 - a^(k + 1)) / (1 - a)

where T(n) is the measured time of one target forward of n tokens (with T(k + 1) = T(1) this is the
textbook (1 - a^(k+1)) / ((1 - a)(k c + 1))). A set's score is the best k in 1..max_k.

* `a` (proxy): teacher-forced top-1 agreement with the full model on the target's own greedy
  continuations of a few calibration prompts (SWIFT uses generated text as ground truth). It is
  computed as drafting sees it: the prefix KV comes from the full model, each draft query attends
  to it plus its own KV (one batched forward with an explicit mask), so one evaluation costs one
  forward of the scored tokens through the skipping view.
* `c`: the share of decode weights the draft still reads (a decode step streams the weights once);
  T(n) is timed. Timing each view directly proved too noisy on a shared 2-core machine.

Search. Bayesian optimisation over 2L binary variables (Draft & Verify) needs hundreds of
evaluations and SWIFT's random search tens per step; on a 2-core CPU one evaluation of the 1.5B
target costs seconds, so the budget is ~100. We therefore (1) score every sub-layer alone on a few
tokens (ablation importance: mean log-probability of the target's token with only that sub-layer
skipped; 2L evaluations), (2) evaluate nested prefixes of that ranking with the full proxy (the
skip ratio sweep), and (3) greedily try adding the next-ranked sub-layers to the best prefix and
removing its last ones while the time budget lasts. The best candidate is then confirmed by a
real timed run (speculative vs plain decode tokens per second, same process); a set whose
expected or measured speedup is not above 1 is written with `recommended: false`, and the
drafter then decodes plainly.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sparrow.drafters.layer_skip import (
    LayerSkipDrafter,
    SkipRecord,
    SkipSet,
    anchor_layers,
    crop_layers,
    find_layers,
    skipping_view,
)
from sparrow.errors import UserError
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.policy.estimates import tokens_per_second
from sparrow.policy.measure import measure_cost_curve
from sparrow.runtime.cached_model import _text_config
from sparrow.runtime.runner import runner_for

CALIBRATION_PROMPTS = (
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists into one sorted "
        "list.\"\"\"\n",
    "Write a Python class `Queue` with enqueue, dequeue and is_empty methods.",
    "The history of the printing press begins in the fifteenth century, when",
)

SubLayer = tuple[str, int]  # ("attention" | "mlp", layer index)


# --- costs -----------------------------------------------------------------------------------------

MIN_DRAFT_SHARE = 0.02
"""A draft step never costs less than this share of a full one (embedding, LM head, the view's overhead)."""


@dataclass(frozen=True)
class CostModel:
    """Seconds of target forwards and of draft steps; draft step = full_draft - saved sub-layers."""

    verify_seconds: tuple[float, ...]  # [max_k + 1]: verify_seconds[n - 1] = target forward of n tokens
    full_draft_seconds: float  # a draft step that skips nothing (the view's own overhead included)
    attention_seconds: float  # saved per skipped attention sub-layer
    mlp_seconds: float  # saved per skipped MLP sub-layer

    @property
    def max_k(self) -> int:
        return len(self.verify_seconds) - 1

    def draft_cost(self, skip: SkipSet) -> float:
        """One draft token in target decode steps."""
        seconds = (self.full_draft_seconds - len(skip.attention) * self.attention_seconds
                   - len(skip.mlp) * self.mlp_seconds)
        return max(seconds, MIN_DRAFT_SHARE * self.full_draft_seconds) / self.verify_seconds[0]

    def speedup(self, acceptance: float, skip: SkipSet, k: int) -> float:
        """Expected tokens per second drafting k tokens a round, over plain decoding's."""
        t1, step = self.verify_seconds[0], self.draft_cost(skip) * self.verify_seconds[0]
        return t1 * tokens_per_second(acceptance, k, lambda k: k * step, lambda n: self.verify_seconds[n - 1])

    def best(self, acceptance: float, skip: SkipSet) -> tuple[int, float]:
        """(k, expected speedup) with the best k in 1..max_k."""
        k = max(range(1, self.max_k + 1), key=lambda k: self.speedup(acceptance, skip, k))
        return k, self.speedup(acceptance, skip, k)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def measure_costs(model: torch.nn.Module, max_k: int, context_tokens: int = 64, repeats: int = 3) -> CostModel:
    """Measured verify curve; draft steps from the weights they read.

    One decode step of a dense model streams its weights once, so a draft step costs T(1) times the
    share of decode weights it still reads (every layer's attention and MLP plus the LM head; the
    embedding table is only indexed). This is deterministic, where timing each view on a shared
    2-core machine was not; the confirming timed run checks the result. The verify curve
    T(1..max_k + 1) is timed by `sparrow.policy.measure_cost_curve`.
    """
    target = runner_for(model)
    verify_seconds = measure_cost_curve(target, max_k, context_tokens=context_tokens, repeats=repeats).verify_seconds
    layers = model.get_submodule(find_layers(model, target.config.num_hidden_layers))
    attention = sum(_numel(layer.self_attn) for layer in layers) / len(layers)
    mlp = sum(_numel(layer.mlp) for layer in layers) / len(layers)
    head = model.get_output_embeddings()
    total = _numel(layers) + (head.weight.numel() if head is not None else 0)
    t1 = verify_seconds[0]
    return CostModel(verify_seconds=verify_seconds, full_draft_seconds=t1, attention_seconds=t1 * attention / total,
                     mlp_seconds=t1 * mlp / total)


# --- the acceptance proxy --------------------------------------------------------------------------

@dataclass(frozen=True)
class Score:
    agreement: float  # top-1 agreement with the full model
    log_prob: float  # mean draft log-probability of the full model's token


class AgreementProxy:
    """Teacher-forced draft predictions, each conditioned on full-model KV of its prefix.

    For a sequence of T tokens whose continuation starts at `start`, query i (position
    p = start - 1 + i) predicts token p + 1. The full model's KV of all T positions is cached once;
    the view then runs the n queries in one forward, each attending to full-model keys at positions
    < p and to its own draft key (mask [n, T + n]), which is exactly what a first draft token sees.
    """

    def __init__(self, model: torch.nn.Module, sequences: Sequence[Tensor], starts: Sequence[int]) -> None:
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device
        self.items = []
        with torch.inference_mode():
            for seq, start in zip(sequences, starts):
                seq = seq.to(self.device)
                n = seq.numel() - start
                assert 1 <= start and n >= 1, (seq.numel(), start)
                cache = DynamicCache()  # plain full layers: sequences are far shorter than any sliding window
                logits = model(input_ids=seq[None], cache=cache, use_cache=True, logits_to_keep=n + 1).logits
                reference = logits[0, :-1].float().argmax(-1)  # [n] full-model prediction at each query
                self.items.append((seq, start, cache, reference))

    @property
    def num_tokens(self) -> int:
        return sum(ref.numel() for *_, ref in self.items)

    def _mask(self, total: int, start: int, n: int, dtype: torch.dtype) -> Tensor:
        positions = torch.arange(start - 1, start - 1 + n, device=self.device)
        full = torch.arange(total, device=self.device)[None, :] < positions[:, None]  # [n, T]
        own = torch.eye(n, dtype=torch.bool, device=self.device)  # [n, n]
        allowed = torch.cat([full, own], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]  # [1, 1, n, T + n]

    @torch.inference_mode()
    def score(self, skip: SkipSet, limit: int | None = None) -> Score:
        """Agreement over the first `limit` queries of each sequence (all when None)."""
        view = skipping_view(self.model, skip)
        dtype = next(self.model.parameters()).dtype
        agree = log_prob = count = 0.0
        for seq, start, cache, reference in self.items:
            n = reference.numel() if limit is None else min(limit, reference.numel())
            total = seq.numel()
            queries = seq[start - 1:start - 1 + n]
            positions = torch.arange(start - 1, start - 1 + n, device=self.device)[None]
            try:
                logits = view(input_ids=queries[None], cache=cache, use_cache=True, position_ids=positions,
                              attention_mask=self._mask(total, start, n, dtype)).logits[0].float()
            finally:
                crop_layers(cache, total)
            agree += float((logits.argmax(-1) == reference[:n]).sum())
            log_prob += float(logits.log_softmax(-1).gather(-1, reference[:n, None]).sum())
            count += n
        return Score(agree / count, log_prob / count)


def calibration_sequences(
    target: LoadedModel, prompts: Sequence[str], new_tokens: int
) -> tuple[list[Tensor], list[int]]:
    """Prompt + the target's own greedy continuation, and where each continuation starts."""
    pipe = Pipeline(target, None)
    sequences, starts = [], []
    for prompt in prompts:
        ids = pipe.encode(prompt).input_ids
        out = pipe.generate_plain(prompt, max_new_tokens=new_tokens).token_ids
        sequences.append(torch.cat([ids, torch.tensor(out, dtype=torch.long)]))
        starts.append(ids.numel())
    return sequences, starts


# --- the search ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    skip: SkipSet
    agreement: float
    draft_cost: float
    num_draft_tokens: int
    expected_speedup: float
    stage: str


class Search:
    """Ranked ablation, nested-prefix sweep, then greedy add / remove refinement (see module doc)."""

    def __init__(self, model: torch.nn.Module, proxy: Callable[[SkipSet, int | None], Score], costs: CostModel,
                 time_budget: float, importance_tokens: int = 6, max_skip_fraction: float = 0.6,
                 progress: Callable[[str, int, int], None] | None = None, ranking_share: float = 0.6) -> None:
        """ranking_share: the share of `time_budget` the ablation ranking may use (the rest: sweep, refinement)."""
        self.num_layers = _text_config(model.config).num_hidden_layers
        anchors = set(anchor_layers(model))
        self.sublayers: list[SubLayer] = [("attention", i) for i in range(self.num_layers) if i not in anchors]
        self.sublayers += [("mlp", i) for i in range(self.num_layers)]
        self.proxy, self.costs = proxy, costs
        self.started, self.time_budget, self.ranking_share = time.monotonic(), time_budget, ranking_share
        self.deadline = self.started + time_budget
        self.importance_tokens = importance_tokens
        self.max_skip = max(1, int(max_skip_fraction * len(self.sublayers)))
        self.progress = progress or (lambda stage, done, total: None)
        self.evaluated: dict[SkipSet, Candidate] = {}

    def skip_set(self, subs: Sequence[SubLayer]) -> SkipSet:
        return SkipSet(self.num_layers, tuple(i for kind, i in subs if kind == "attention"),
                       tuple(i for kind, i in subs if kind == "mlp"))

    def evaluate(self, subs: Sequence[SubLayer], stage: str) -> Candidate:
        skip = self.skip_set(subs)
        if skip not in self.evaluated:
            score = self.proxy(skip, None)
            k, speedup = self.costs.best(score.agreement, skip)
            self.evaluated[skip] = Candidate(skip, score.agreement, self.costs.draft_cost(skip), k, speedup, stage)
        return self.evaluated[skip]

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def rank(self) -> list[SubLayer]:
        """Sub-layers, least harmful to skip first (ablation importance on a few tokens)."""
        scores = {}
        for done, sub in enumerate(self.sublayers):
            self.progress("importance", done, len(self.sublayers))
            if time.monotonic() > self.started + self.ranking_share * self.time_budget:  # leave time for the sweep
                break
            scores[sub] = self.proxy(self.skip_set([sub]), self.importance_tokens).log_prob
        self.progress("importance", len(self.sublayers), len(self.sublayers))
        return sorted(self.sublayers, key=lambda s: -scores.get(s, float("-inf")))

    def run(self) -> Candidate:
        ranking = self.rank()
        sizes = sorted({max(1, round(self.max_skip * f / 10)) for f in range(1, 11)})
        empty = self.skip_set([])  # the full model as its own draft: agreement 1, cost 1
        k, speedup = self.costs.best(1.0, empty)
        best = Candidate(empty, 1.0, self.costs.draft_cost(empty), k, speedup, "none")
        for done, m in enumerate(sizes):  # the skip-ratio sweep
            self.progress("sweep", done, len(sizes))
            if self.out_of_time():
                break
            candidate = self.evaluate(ranking[:m], "sweep")
            best = max(best, candidate, key=lambda c: c.expected_speedup)
        self.progress("sweep", len(sizes), len(sizes))
        chosen = [s for s in ranking if s in set(self._subs(best.skip))]
        rest = [s for s in ranking if s not in chosen]
        moves = [("add", s) for s in rest[: len(rest) // 2]] + [("remove", s) for s in reversed(chosen)]
        for done, (move, sub) in enumerate(moves):  # greedy refinement, first improvement
            self.progress("refine", done, len(moves))
            if self.out_of_time():
                break
            trial = chosen + [sub] if move == "add" else [s for s in chosen if s != sub]
            if not trial or len(trial) > self.max_skip:
                continue
            candidate = self.evaluate(trial, "refine")
            if candidate.expected_speedup > best.expected_speedup:
                best, chosen = candidate, trial
        self.progress("refine", len(moves), len(moves))
        return best

    @staticmethod
    def _subs(skip: SkipSet) -> list[SubLayer]:
        return [("attention", i) for i in skip.attention] + [("mlp", i) for i in skip.mlp]


# --- confirmation and the whole tuning run ----------------------------------------------------------

def measure_speedup(target: LoadedModel, skip: SkipSet, k: int, prompts: Sequence[str], new_tokens: int) -> float:
    """Decode tokens per second with the layer-skip drafter over plain decoding (same process, greedy)."""
    drafter = LayerSkipDrafter(target.model, skip, k, adaptive=True, backoff=False)
    spec, plain = Pipeline(target, drafter), Pipeline(target, None)
    spec.generate("Hello", max_new_tokens=4)  # warm-up
    plain.generate_plain("Hello", max_new_tokens=4)
    spec_seconds = plain_seconds = 0.0
    for prompt in prompts:
        a = spec.generate(prompt, max_new_tokens=new_tokens)
        b = plain.generate_plain(prompt, max_new_tokens=new_tokens)
        spec_seconds += (a.seconds - a.stats.prefill_seconds) / max(1, a.new_tokens)
        plain_seconds += (b.seconds - b.stats.prefill_seconds) / max(1, b.new_tokens)
    return plain_seconds / spec_seconds


def tune_layer_skip(target: LoadedModel, *, max_k: int = 8, prompts: Sequence[str] = CALIBRATION_PROMPTS,
                    new_tokens: int = 24, time_budget: float = 300.0, confirm_prompts: Sequence[str] | None = None,
                    confirm_tokens: int = 48, costs: CostModel | None = None,
                    measure: Callable[[SkipSet, int], float] | None = None,
                    progress: Callable[[str, int, int], None] | None = None,
                    say: Callable[[str], None] = lambda message: None) -> SkipRecord:
    """Search, confirm and return the record (not yet saved). `costs` / `measure` can be injected (tests)."""
    if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
        raise UserError(f"k (num_draft_tokens) must be an integer >= 1, got {max_k!r}")
    if not prompts or new_tokens < 2:
        raise UserError("tuning needs at least one calibration prompt and new_tokens >= 2")
    started = time.monotonic()
    say(f"calibration: the target's greedy continuations of {len(prompts)} prompts")
    sequences, starts = calibration_sequences(target, prompts, new_tokens)
    proxy = AgreementProxy(target.model, sequences, starts)
    if costs is None:
        say("timing target forwards and draft steps")
        costs = measure_costs(target.model, max_k)
    say(f"cost model: decode step {costs.verify_seconds[0] * 1e3:.0f} ms, verify {max_k + 1} tokens "
        f"{costs.verify_seconds[-1] * 1e3:.0f} ms, per attention {costs.attention_seconds * 1e3:.1f} ms, "
        f"per MLP {costs.mlp_seconds * 1e3:.1f} ms")
    search = Search(target.model, proxy.score, costs, time_budget=time_budget, progress=progress)
    best = search.run()
    say(f"best: {best.skip} -> agreement {best.agreement:.2f}, draft cost {best.draft_cost:.2f}, "
        f"k={best.num_draft_tokens}, expected {best.expected_speedup:.2f}x ({len(search.evaluated)} sets evaluated)")
    measured = None
    if best.skip.num_skipped and confirm_tokens > 0:
        say("confirming with a timed run")
        if measure is None:
            def measure(skip: SkipSet, k: int) -> float:
                return measure_speedup(target, skip, k, confirm_prompts or prompts[:2], confirm_tokens)
        measured = float(measure(best.skip, best.num_draft_tokens))
    wins = best.skip.num_skipped > 0 and best.expected_speedup > 1.0 and (measured is None or measured > 1.0)
    if wins:
        note = "recommended"
    elif not best.skip.num_skipped:
        note = "refused: no skip set is expected to beat plain decoding"
    else:
        note = (f"refused: expected {best.expected_speedup:.2f}x, measured "
                f"{'-' if measured is None else f'{measured:.2f}x'} (not above 1)")
    top = sorted(search.evaluated.values(), key=lambda c: -c.expected_speedup)[:8]
    details = {
        "device": str(proxy.device),
        "calibration_tokens": proxy.num_tokens,
        "sets_evaluated": len(search.evaluated),
        "seconds": round(time.monotonic() - started, 1),
        "cost_model": {
            "verify_ms": [round(s * 1e3, 2) for s in costs.verify_seconds],
            "full_draft_ms": round(costs.full_draft_seconds * 1e3, 2),
            "attention_ms": round(costs.attention_seconds * 1e3, 3),
            "mlp_ms": round(costs.mlp_seconds * 1e3, 3),
        },
        "top_candidates": [
            {
                "skip_set": str(c.skip),
                "agreement": round(c.agreement, 4),
                "draft_cost": round(c.draft_cost, 4),
                "k": c.num_draft_tokens,
                "expected_speedup": round(c.expected_speedup, 4),
                "stage": c.stage,
            }
            for c in top
        ],
    }
    return SkipRecord(model=target.name, skip=best.skip, num_draft_tokens=best.num_draft_tokens,
                      agreement=round(best.agreement, 4), draft_cost=round(best.draft_cost, 4),
                      expected_speedup=round(best.expected_speedup, 4),
                      measured_speedup=None if measured is None else round(measured, 4), recommended=wins,
                      date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), note=note, details=details)
