"""Visual-prune (SpecVLM) drafting: the pure two-stage selection, pruned positions, and losslessness on
tiny random Qwen2.5-VL / LLaVA-OneVision models with synthetic videos and images."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.drafters.visual_prune import plan_pruning, prune_visual_tokens, visual_budget

pytestmark = pytest.mark.usefixtures("one_thread")


def test_budget_and_stages_on_a_known_case():
    scores = torch.tensor([0.0, 5.0, 1.0, 0.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # total 10
    plan = plan_pruning(scores, budget=4, mass=0.5)
    assert plan.salient.tolist() == [1]  # 5 >= 0.5 * 10
    assert plan.kept.tolist() == sorted(plan.salient.tolist() + plan.uniform.tolist())
    # Stage II: linspace over the 9 remaining tokens [0, 2, 3, ..., 9] -> offsets 0, 4, 8
    assert plan.uniform.tolist() == [0, 5, 9]
    plan = plan_pruning(scores, budget=4, mass=0.8)  # 5 + 3 = 8 >= 8
    assert plan.salient.tolist() == [1, 4] and len(plan.uniform) == 2
    assert prune_visual_tokens(scores, budget=1, mass=0.8).tolist() == [1]  # Stage I capped at the budget


def test_drop_rate_budget():
    assert visual_budget(100, 0.9) == 10 and visual_budget(16, 0.9) == 1 and visual_budget(16, 0.0) == 16
    assert prune_visual_tokens(torch.rand(100), drop_rate=0.9).numel() == 10
    with pytest.raises(ValueError, match="drop_rate"):
        visual_budget(10, 1.0)
    with pytest.raises(ValueError, match="exactly one"):
        plan_pruning(torch.rand(4), budget=2, drop_rate=0.5)
    with pytest.raises(ValueError, match="budget"):
        plan_pruning(torch.rand(4), budget=5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=60), st.data(), st.floats(0.0, 1.0))
def test_selection_properties(values, data, mass):
    scores = torch.tensor(values)
    n = scores.numel()
    budget = data.draw(st.integers(0, n))
    plan = plan_pruning(scores, budget=budget, mass=mass)
    kept = plan.kept.tolist()
    assert len(kept) == budget == len(set(kept))  # exactly the budget, no duplicates
    assert kept == sorted(kept)  # order preserved
    assert set(plan.salient.tolist()).isdisjoint(plan.uniform.tolist())
    total = float(scores.sum())
    if budget and total > 0:
        s = plan.salient
        covered = float(scores[s].sum()) >= mass * total - 1e-5 * total
        assert covered or s.numel() == budget  # Stage I covers the mass unless capped
        if s.numel() > 1:  # smallest such set: without its weakest member the mass is not covered
            assert float(scores[s].sum() - scores[s].min()) < mass * total + 1e-5 * total
        if s.numel():  # Stage I holds top scores
            rest = [i for i in range(n) if i not in set(s.tolist())]
            assert not rest or float(scores[s].min()) >= float(scores[rest].max())


# --- tiny Video-LLMs --------------------------------------------------------------------------------------

from vlm_models import KINDS, byte_tokenizer, moving_squares, perturbed, tiny_processor, tiny_vlm  # noqa: E402

from sparrow.drafters import build_drafter  # noqa: E402
from sparrow.drafters.visual_prune import PrunedView, pruned_decoder_inputs  # noqa: E402
from sparrow.models import LoadedModel  # noqa: E402
from sparrow.pipeline import Pipeline  # noqa: E402
from sparrow.runtime.runner import runner_for  # noqa: E402
from sparrow.types import Prompt  # noqa: E402
from sparrow.vision.prompt import visual_token_positions  # noqa: E402
from sparrow.vision.video import Video  # noqa: E402

QUESTION = "What moves?"
MEDIA = {"video8": dict(video=Video.from_array(moving_squares(8))),
         "video16": dict(video=Video.from_array(moving_squares(16)))}


def _media(name: str) -> dict:
    if name == "image":
        from PIL import Image

        return dict(image=Image.fromarray(moving_squares(1, 64, 64)[0]))
    return MEDIA[name]


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
    tok = byte_tokenizer()
    model = tiny_vlm(request.param, tok, seed=0)
    target = LoadedModel(model, tok, request.param, tiny_processor(request.param, tok))
    close = LoadedModel(perturbed(model, 0.05, seed=1), tok, "close", target.processor)
    return target, close


@pytest.mark.parametrize("media", ["video8", "video16", "image"])
@pytest.mark.parametrize("draft", ["self", "close"])
def test_visual_prune_greedy_equals_plain(vlm, media, draft):
    target, close = vlm
    plain = Pipeline(target, None).generate_plain(QUESTION, max_new_tokens=30, **_media(media)).token_ids
    drafted = accepted = 0
    for drop_rate in (0.5, 0.9):
        drafter = build_drafter("visual-prune", target, None if draft == "self" else close, 4, drop_rate=drop_rate)
        result = Pipeline(target, drafter).generate(QUESTION, max_new_tokens=30, **_media(media))
        assert result.token_ids == plain, (media, draft, drop_rate)
        assert drafter.last_pruning is not None and drafter.last_pruning.kept.numel() < drafter.last_visual.numel()
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    assert 0 < accepted <= drafted


def test_no_pruning_self_draft_accepts_everything(vlm):
    target, _ = vlm
    drafter = build_drafter("visual-prune", target, None, 4, drop_rate=0.0)
    result = Pipeline(target, drafter).generate(QUESTION, max_new_tokens=20, **_media("video8"))
    assert result.stats.num_accepted_tokens == result.stats.num_draft_tokens > 0


def test_pruned_decode_positions_match_a_pruned_full_forward(vlm):
    """Decoding after a pruned prefill == prefilling the pruned prompt + token at once (positions included)."""
    target, _ = vlm
    pipe = Pipeline(target, None)
    prompt = pipe.encode(QUESTION, video=MEDIA["video8"]["video"])
    n = prompt.input_ids.numel()
    visual = visual_token_positions(prompt, target.model.config)
    keep_mask = torch.ones(n, dtype=torch.bool)
    keep_mask[visual[1::2]] = False  # drop every other visual token
    keep = keep_mask.nonzero()[:, 0]
    view = PrunedView(runner_for(target.model))
    view.prefill(prompt, keep)
    token = torch.tensor([5])
    decoded = view.forward(token).logits[-1]
    inputs = dict(prompt.model_inputs)
    if "mm_token_type_ids" in inputs:
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.long)], 1)
    longer = Prompt(torch.cat([prompt.input_ids, token]), inputs)
    with pruned_decoder_inputs(target.model, torch.cat([keep, torch.tensor([n])])):
        reference = runner_for(target.model).prefill(longer).logits[-1]
    assert view.length == n + 1 and view.runner.length == keep.numel() + 1
    torch.testing.assert_close(decoded, reference, atol=1e-4, rtol=1e-4)


def test_visual_prune_needs_its_target(vlm):
    target, close = vlm
    drafter = build_drafter("visual-prune", target, close, 4)
    with pytest.raises(ValueError, match="target model it was built on"):
        drafter.prefill(Prompt(torch.tensor([1, 2, 3])), runner_for(close.model))


def test_visual_prune_rejects_a_text_only_draft(vlm):
    from conftest import tiny_model

    target, _ = vlm
    text = LoadedModel(tiny_model("qwen2", seed=0, vocab_size=target.model.config.get_text_config().vocab_size),
                       target.tokenizer, "text")
    with pytest.raises(ValueError, match="vision-language draft model"):
        build_drafter("visual-prune", target, text, 4)
    with pytest.raises(ValueError, match="drop_rate"):
        build_drafter("visual-prune", target, None, 4, drop_rate=1.0)
