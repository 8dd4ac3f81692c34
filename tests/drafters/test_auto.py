"""The auto drafter: lossless whatever it picks, and its picks follow measured costs.

Costs are injected: a fake clock advances by a fixed cost per target forward (verification) and
per draft-model forward, and the engine measures each round with it (the drafter reads the engine's
timings), so every decision is deterministic and independent of wall time.
"""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_model

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.decoding import engine
from sparrow.drafters import REGISTRY, build_drafter
from sparrow.drafters import auto as auto_module
from sparrow.drafters.auto import PLAIN, AutoConfig, AutoDrafter
from sparrow.drafters.draft_model import DraftModelDrafter
from sparrow.drafters.prompt_lookup import PromptLookupDrafter
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.policy.estimates import DecayedLine
from sparrow.policy.measure import follow_cost_curve
from sparrow.runtime.cached_model import CachedModel

PROMPTS = ["The quick brown fox", "def add(a, b):", "for i in range(10):"]
REPETITIVE = "Paris is the capital of France. Berlin is the capital of Germany. Paris is the capital of"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def charge(self, model: CachedModel, seconds) -> None:
        """Each forward of `model` advances the clock by seconds(num_tokens)."""
        forward = model.forward

        def timed(tokens, *args, **kwargs):
            self.now += seconds(tokens.numel())
            return forward(tokens, *args, **kwargs)

        model.forward = timed


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """The engine's clock, for the duration of one test."""
    fake = FakeClock()
    monkeypatch.setattr(engine, "now", lambda device=None, sync=True: fake())
    monkeypatch.setattr(auto_module, "now", lambda device=None, sync=True: fake())  # auto times a draft's catch-up
    return fake


def auto_pipeline(clock: FakeClock, target: LoadedModel, draft: LoadedModel | None, draft_cost,
                  lookup: bool = True, k: int = 8, verifier: str = "auto") -> Pipeline:
    """Target forward: 1 s + 0.02 s per extra token; draft forward: `draft_cost` s (or draft_cost(tokens fed));
    lookup: free."""
    candidates = [PromptLookupDrafter(k, adaptive=True)] if lookup else []
    if draft is not None:
        drafter = DraftModelDrafter(CachedModel(draft.model), CachedModel(target.model).vocab_size, k, adaptive=True)
        clock.charge(drafter.draft, draft_cost if callable(draft_cost) else lambda n: draft_cost)
        candidates.append(drafter)
    pipe = Pipeline(target, AutoDrafter(candidates), verifier)
    clock.charge(pipe.runner, lambda n: 1.0 + 0.02 * (n - 1))
    return pipe


@pytest.fixture(scope="module")
def drafts(target_model, tokenizer, arch) -> dict[str, LoadedModel]:
    return {
        "same": LoadedModel(target_model, tokenizer, "same"),
        "close": LoadedModel(perturbed(target_model, 0.05, seed=1), tokenizer, "close"),
        "random": LoadedModel(tiny_model(arch, seed=99), tokenizer, "random"),
    }


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tokenizer) -> dict[str, LoadedModel]:
    """The policy tests need one architecture only: a target, a good draft and a useless one."""
    target = tiny_model("llama", seed=0)
    return {"target": LoadedModel(target, tokenizer, "tiny"),
            "close": LoadedModel(perturbed(target, 0.05, seed=1), tokenizer, "close"),
            "random": LoadedModel(tiny_model("llama", seed=99), tokenizer, "random")}


def used(drafter: AutoDrafter, name: str) -> tuple[int, int, int]:
    """(rounds, drafted, accepted) of the rounds that used `name`."""
    rounds = [r for r in drafter.rounds if r.choice == name]
    return len(rounds), sum(r.drafted for r in rounds), sum(r.accepted for r in rounds)


def test_good_draft_model_is_chosen_and_output_equals_plain(clock, loaded_target, drafts):
    pipe = auto_pipeline(clock, loaded_target, drafts["close"], draft_cost=0.05)
    accepted = 0
    for prompt in PROMPTS[:2]:
        plain = pipe.generate_plain(prompt, max_new_tokens=30).token_ids
        assert pipe.generate(prompt, max_new_tokens=30).token_ids == plain, (prompt, pipe.drafter.choices)
        rounds, _, model_accepted = used(pipe.drafter, "draft-model")
        assert rounds >= 2 and pipe.drafter.choices.count(PLAIN) < len(pipe.drafter.choices) // 2, pipe.drafter.choices
        accepted += model_accepted
    assert accepted > 0


def test_prompt_lookup_wins_on_repetitive_text_and_output_equals_plain(clock, loaded_target, drafts):
    pipe = auto_pipeline(clock, loaded_target, drafts["close"], draft_cost=0.05)
    plain = pipe.generate_plain(REPETITIVE, max_new_tokens=50).token_ids
    result = pipe.generate(REPETITIVE, max_new_tokens=50)
    assert result.token_ids == plain
    assert result.stats.num_accepted_tokens > 0
    rounds, _, accepted = used(pipe.drafter, "prompt-lookup")
    assert rounds > 0 and accepted > 0, pipe.drafter.choices


def test_same_draft_stays_in_sync_across_switches(clock, loaded_target, drafts):
    """draft == target: whenever the draft model drafts, after any number of lookup or plain rounds,
    every token is accepted, so its cache re-synced from the committed tokens."""
    pipe = auto_pipeline(clock, loaded_target, drafts["same"], draft_cost=0.05)
    for prompt in [REPETITIVE, PROMPTS[0]]:
        plain = pipe.generate_plain(prompt, max_new_tokens=40).token_ids
        assert pipe.generate(prompt, max_new_tokens=40).token_ids == plain
        rounds, drafted, accepted = used(pipe.drafter, "draft-model")
        assert rounds > 0 and accepted == drafted > 0


def test_a_draft_models_catch_up_is_not_counted_as_drafting(clock, loaded_target, drafts):
    """After rounds of other options the draft model is fed the tokens committed meanwhile (one forward): the cost
    of switching, not of drafting. Counted as drafting, a probe after many rounds measured a good draft as slower
    than plain decoding and kept it out."""
    fed = []

    def cost(tokens: int) -> float:
        fed.append(tokens)
        return 0.05 if tokens <= 2 else 5.0  # a catch-up costs far more than the chain's own forwards (1-2 tokens)

    pipe = auto_pipeline(clock, loaded_target, drafts["same"], draft_cost=cost)
    model = pipe.drafter.candidates["draft-model"]
    seen = []
    observe = model.observe

    def spy(draft, verdict, out=None, step=None):
        seen.append((len(draft), step.draft_seconds))
        observe(draft, verdict, out, step)

    model.observe = spy
    plain = pipe.generate_plain(REPETITIVE, max_new_tokens=60).token_ids
    assert pipe.generate(REPETITIVE, max_new_tokens=60).token_ids == plain
    assert any(tokens > 2 for tokens in fed), fed  # it did catch up after other options' rounds
    assert seen and all(seconds <= 0.05 * drafted + 1e-9 for drafted, seconds in seen), seen
    assert used(pipe.drafter, "draft-model")[2] > 0


def test_useless_draft_falls_back_to_plain_and_reprobes_rarely(clock, llama):
    pipe = auto_pipeline(clock, llama["target"], llama["random"], draft_cost=0.3, lookup=False)
    plain = pipe.generate_plain(PROMPTS[0], max_new_tokens=130).token_ids
    assert pipe.generate(PROMPTS[0], max_new_tokens=130).token_ids == plain
    choices = pipe.drafter.choices
    probe_rounds = AutoConfig().probe_rounds
    assert choices[:probe_rounds] == ["draft-model"] * probe_rounds
    assert choices[probe_rounds:probe_rounds + 4] == [PLAIN] * 4  # falls back within a few rounds
    assert choices[probe_rounds:].count("draft-model") <= 4  # re-probes at growing intervals: 8, 16, 32, 64...
    assert len(choices) > 100


def test_injected_costs_drive_the_choice(clock, llama):
    """The same draft pays when it is cheap and not when it costs as much as the target."""
    shares = {}
    for cost in (0.02, 1.0):
        pipe = auto_pipeline(clock, llama["target"], llama["close"], draft_cost=cost, lookup=False)
        pipe.generate(PROMPTS[1], max_new_tokens=40)
        shares[cost] = pipe.drafter.choices.count("draft-model") / len(pipe.drafter.choices)
    assert shares[0.02] > 0.8 and shares[1.0] < 0.2, shares


def test_builds_from_the_registry_with_and_without_a_draft_model(loaded_target, drafts):
    assert REGISTRY["auto"].uses_draft_model and not REGISTRY["auto"].needs_draft_model
    alone = build_drafter("auto", loaded_target)
    assert list(alone.candidates) == ["prompt-lookup", "suffix"]
    assert list(build_drafter("auto", loaded_target, suffix=False).candidates) == ["prompt-lookup"]
    paired = build_drafter("auto", loaded_target, drafts["close"], num_draft_tokens=4)
    assert list(paired.candidates)[:2] == ["prompt-lookup", "draft-model"]
    assert paired.candidates["draft-model"].length.max_tokens == 4  # -k caps every candidate
    pipe = Pipeline(loaded_target, paired)
    plain = pipe.generate_plain(PROMPTS[0], max_new_tokens=30).token_ids
    assert pipe.generate(PROMPTS[0], max_new_tokens=30).token_ids == plain
    assert len(pipe.drafter.choices) == len(pipe.drafter.rounds) > 0


def test_a_quantized_draft_inside_auto_follows_the_cost_curve_as_it_does_alone(loaded_target, drafts):
    """With a quantized kernel the pipeline switches draft-model's policy to the measured cost curve; inside auto
    its draft-model candidate gets the same (it drafted 5.8 tokens a round on code where alone it drafted 7.1)."""
    auto = build_drafter("auto", loaded_target, drafts["close"], num_draft_tokens=4, adaptive=True)
    follow_cost_curve(auto, CachedModel(loaded_target.model))
    assert auto.candidates["draft-model"].length.curve is not None
    assert auto.candidates["prompt-lookup"].length.curve is None  # no draft model: its own rule
    pipe = Pipeline(loaded_target, auto)
    plain = pipe.generate_plain(PROMPTS[0], max_new_tokens=30).token_ids
    assert pipe.generate(PROMPTS[0], max_new_tokens=30).token_ids == plain


def test_layer_skip_candidate_shares_the_target_cache_and_output_equals_plain(clock, loaded_target):
    """A self-draft reading and cropping the target's own cache, mixed with lookup and plain rounds."""
    from sparrow.drafters.layer_skip import LayerSkipDrafter, SkipSet

    skipper = LayerSkipDrafter(loaded_target.model, SkipSet(2, mlp=(1,)), 4, backoff=False)
    pipe = Pipeline(loaded_target, AutoDrafter([PromptLookupDrafter(8, adaptive=True), skipper]))
    clock.charge(pipe.runner, lambda n: 1.0)  # skipping costs nothing here: it drafts
    for prompt in (REPETITIVE, PROMPTS[1]):
        plain = pipe.generate_plain(prompt, max_new_tokens=40).token_ids
        assert pipe.generate(prompt, max_new_tokens=40).token_ids == plain
        rounds, _, accepted = used(pipe.drafter, "layer-skip")
        assert rounds > 0 and accepted > 0, pipe.drafter.choices


def test_bad_candidates_are_refused():
    with pytest.raises(ValueError, match="distinct names"):
        AutoDrafter([PromptLookupDrafter(), PromptLookupDrafter()])
    with pytest.raises(ValueError, match="forgetting"):
        AutoConfig(forgetting=1.5)


def test_verify_cost_fits_intercept_and_slope():
    cost = DecayedLine(AutoConfig().verify_decay)
    for n in (1, 9, 1, 5, 17):
        cost.add(n, 0.5 + 0.01 * (n - 1))
    _, b = cost.line()
    assert cost(1) == pytest.approx(0.5) and b == pytest.approx(0.01)


def test_sampling_with_auto_keeps_the_target_distribution(clock, llama):
    """Cheap check: the 2nd new token (the first one a draft can supply) follows the target's marginal
    sum_t1 p(t1 | prompt) p(t2 | prompt, t1), within 6 sigma + 5 per bin, while the draft model drafts."""
    loaded_target = llama["target"]
    pipe = auto_pipeline(clock, loaded_target, llama["close"], draft_cost=0.02)
    sampling = SamplingConfig(temperature=1.0)
    ids = pipe.encode(PROMPTS[0]).input_ids
    with torch.inference_mode():
        logits = loaded_target.model(ids[None]).logits[0, -1]
        p1 = S.probs(logits, sampling)  # [V]
        vocab = p1.numel()
        batch = torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)  # [V, n + 1]
        p2 = S.probs(loaded_target.model(batch).logits[:, -1], sampling)  # [V, V]
        eos = list(pipe.eos_token_ids())
        stop = p1[eos].sum()  # the first token is EOS: there is no second one (last bin)
        p1 = p1.clone().index_fill_(0, torch.tensor(eos, dtype=torch.long), 0.0)
        expected = torch.cat([p1 @ p2, stop.reshape(1)]).clone()  # [V + 1]
    n, counts, drafted = 400, torch.zeros(vocab + 1), 0
    for seed in range(n):
        result = pipe.generate(PROMPTS[0], max_new_tokens=3, temperature=1.0, seed=seed)
        counts[result.token_ids[1] if len(result.token_ids) > 1 else vocab] += 1
        drafted += used(pipe.drafter, "draft-model")[1]
    assert drafted > n // 2  # drafts were really verified (seeded: the coupled rule, sparrow.noise)
    bound = 6 * (n * expected * (1 - expected)).sqrt() + 5
    assert bool(((counts - n * expected).abs() <= bound).all())
