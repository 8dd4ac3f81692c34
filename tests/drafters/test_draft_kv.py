"""Draft-side KV policies for drafters with their own visual cache (draft-model with a VLM draft, visual-prune)
and HybridKV's per-round chunk retrieval (those two and sparse): lossless on tiny Qwen2.5-VL / LLaVA-OneVision,
the draft's visual KV within the budget (cache tensor sizes), exact positions after compaction, refusals."""

from __future__ import annotations

import pytest
import torch
from vlm_models import KINDS, byte_tokenizer, moving_squares, perturbed, tiny_processor, tiny_vlm

from sparrow.drafters import build_drafter
from sparrow.drafters.kv.compress import HybridKV
from sparrow.drafters.kv.draft_kv import DraftKV, DraftKVConfig, draft_kv_config, kv_bytes, with_draft_kv
from sparrow.drafters.visual_prune import VisualPruneDrafter, visual_span
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.runtime.runner import runner_for
from sparrow.vision.video import Video

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTION = "What moves?"
VIDEO = dict(video=Video.from_array(moving_squares(16)))
BUDGET = 8
TOKENS = 30


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
    tok = byte_tokenizer()
    model = tiny_vlm(request.param, tok, seed=0)
    target = LoadedModel(model, tok, request.param, tiny_processor(request.param, tok))
    close = LoadedModel(perturbed(model, 0.05, seed=1), tok, "close", target.processor)
    plain = Pipeline(target, None).generate_plain(QUESTION, max_new_tokens=TOKENS, **VIDEO).token_ids
    return target, close, plain


def drafter_with(name: str, target: LoadedModel, close: LoadedModel, config: DraftKVConfig | None):
    """visual-prune self-draft / with the close VLM (drop half the video first), or draft-model with it."""
    if name == "draft-model":
        drafter = build_drafter("draft-model", target, close, 4)
        drafter.draft = with_draft_kv(drafter.draft, config)
        return drafter
    draft = target if name == "visual-prune-self" else close
    return VisualPruneDrafter(target.model, draft.model, 4, drop_rate=0.5, draft_kv=config)


def prefill(drafter, target: LoadedModel):
    """Prefill target and drafter as the engine does; returns the prompt."""
    prompt = Pipeline(target, None).encode(QUESTION, **VIDEO)
    runner = runner_for(target.model)
    with drafter.watch_prefill(runner):
        runner.prefill(prompt)
    drafter.prefill(prompt, runner)
    return prompt


DRAFTERS = ["visual-prune-self", "visual-prune-close", "draft-model"]


@pytest.mark.parametrize("policy", ["topk", "mm-shiftkv", "hybridkv"])
@pytest.mark.parametrize("name", DRAFTERS)
def test_policy_is_lossless_and_keeps_the_visual_kv_within_the_budget(vlm, name, policy):
    target, close, plain = vlm
    drafter = drafter_with(name, target, close, DraftKVConfig(policy, budget=BUDGET))
    result = Pipeline(target, drafter).generate(QUESTION, max_new_tokens=TOKENS, **VIDEO)
    assert result.token_ids == plain
    assert 0 < result.stats.num_accepted_tokens <= result.stats.num_draft_tokens
    # The cache tensors right after the draft's prefill: all text entries plus BUDGET visual ones per KV head.
    full = drafter_with(name, target, close, None)
    prefill(full, target)
    prefill(drafter, target)
    view = drafter.draft
    assert isinstance(view, DraftKV) and view.dropped > 0
    start, end = view.span
    before = runner_of(full).length  # the draft cache without a policy
    assert before == view.runner.length + view.dropped
    text = before - (end - start)
    kv_heads = target.model.config.get_text_config().num_key_value_heads
    for layer, kept in zip(view.runner.cache.layers, view.kept):
        assert layer.keys.shape[:3] == layer.values.shape[:3] == (1, kv_heads, text + BUDGET)
        assert int(((kept >= start) & (kept < end)).sum(-1).max()) == BUDGET
    assert view.visual_entries == BUDGET < end - start
    assert kv_bytes(view.runner.cache) < kv_bytes(runner_of(full).cache)


def runner_of(drafter):
    return getattr(drafter.draft, "runner", drafter.draft)


def test_no_budget_pressure_changes_nothing(vlm):
    """A budget above the visual token count drops nothing: same drafts as without a policy."""
    target, close, plain = vlm
    stats = []
    for config in (None, DraftKVConfig("hybridkv", budget=10_000)):
        result = Pipeline(target, drafter_with("draft-model", target, close, config)).generate(
            QUESTION, max_new_tokens=TOKENS, **VIDEO)
        assert result.token_ids == plain
        stats.append((result.stats.num_draft_tokens, result.stats.num_accepted_tokens))
    assert stats[0] == stats[1]


def test_text_only_prompt_keeps_every_entry(vlm):
    target, close, _ = vlm
    plain = Pipeline(target, None).generate_plain(QUESTION, max_new_tokens=12).token_ids
    drafter = drafter_with("draft-model", target, close, DraftKVConfig("mm-shiftkv", budget=2))
    assert Pipeline(target, drafter).generate(QUESTION, max_new_tokens=12).token_ids == plain
    assert drafter.draft.dropped == 0


def test_compacted_draft_matches_a_masked_full_cache(vlm):
    """Positions stay exact: after compaction, decoding (chain, rewind, tree) gives the logits of the full cache
    with the dropped entries masked out (a selector keeping the same entries for every head, so a 2-D mask can
    express it)."""
    target, _, _ = vlm
    model = target.model
    prompt = Pipeline(target, None).encode(QUESTION, **VIDEO)
    n = prompt.input_ids.numel()
    view = DraftKV(runner_for(model), DraftKVConfig("topk", budget=5))
    view.selector = lambda q, k, budget, span, *, layer, scaling: torch.arange(
        span[0] + 3, span[0] + 3 + budget).expand(k.shape[0], budget)
    view.prefill(prompt)
    reference = runner_for(model)
    reference.prefill(prompt)
    start, end = view.span
    allowed = torch.ones(n, dtype=torch.bool)
    allowed[start:end] = False
    allowed[start + 3:start + 8] = True
    assert view.dropped == end - start - 5 and view.length == n
    tokens = torch.tensor([5, 17, 33])
    mask = torch.cat([allowed.expand(3, n), torch.ones(3, 3, dtype=torch.bool).tril()], 1)
    torch.testing.assert_close(view.forward(tokens).logits, reference.forward(tokens, mask=mask).logits,
                               atol=1e-5, rtol=1e-5)
    view.rewind(n + 1)
    reference.rewind(n + 1)
    positions = torch.tensor([n + 1, n + 1])  # two siblings at depth 1 of a tree
    tree = torch.zeros(2, n + 3, dtype=torch.bool)
    tree[:, :n + 1] = True
    tree[0, n + 1] = tree[1, n + 2] = True
    masked = tree.clone()
    masked[:, :n] &= allowed
    torch.testing.assert_close(view.forward(torch.tensor([7, 9]), positions, tree).logits,
                               reference.forward(torch.tensor([7, 9]), positions, masked).logits, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_equals_seeded_plain_decoding(vlm):
    target, close, _ = vlm
    options = dict(max_new_tokens=20, temperature=0.8, seed=3, **VIDEO)
    plain = Pipeline(target, None).generate_plain(QUESTION, **options).token_ids
    for name in ("visual-prune-self", "draft-model"):
        drafter = drafter_with(name, target, close, DraftKVConfig("mm-shiftkv", budget=4))
        assert Pipeline(target, drafter).generate(QUESTION, **options).token_ids == plain, name


def test_tree_drafting_with_a_policy_is_lossless(vlm):
    target, close, plain = vlm
    drafter = build_drafter("draft-model", target, close, 4, tree_budget=6, draft_kv="mm-shiftkv",
                            draft_kv_budget=BUDGET)
    result = Pipeline(target, drafter).generate(QUESTION, max_new_tokens=TOKENS, **VIDEO)
    assert result.token_ids == plain and result.stats.num_accepted_tokens > 0


# --- HybridKV per-round chunk retrieval ---------------------------------------------------------------------

RETRIEVING = DraftKVConfig("hybridkv", budget=BUDGET, retrieve_every=1, static_threshold=1.0, chunk=4)
"""static_threshold 1: every head dynamic, so each layer retrieves."""


@pytest.mark.parametrize("name", [*DRAFTERS, "sparse"])
def test_per_round_retrieval_changes_the_selection_and_stays_lossless(vlm, name):
    target, close, plain = vlm
    if name == "sparse":
        drafter = build_drafter("sparse", target, None, 4, budget=BUDGET, sinks=2, window=4,
                                span=visual_span(target.model.config), selector=HybridKV(1.0, 4), retrieve_every=1)
    else:
        drafter = drafter_with(name, target, close, RETRIEVING)
    result = Pipeline(target, drafter).generate(QUESTION, max_new_tokens=TOKENS, **VIDEO)
    assert result.token_ids == plain and result.stats.num_accepted_tokens > 0
    retrieval = drafter.retrieval if name == "sparse" else drafter.draft.retrieval
    layers = target.model.config.get_text_config().num_hidden_layers
    assert len(retrieval.layout) == layers and retrieval.rounds > 1
    assert retrieval.retrievals == layers * retrieval.rounds  # every round, every layer
    assert retrieval.changes > 0  # the chunks moved with the draft's queries
    if name != "sparse":  # the cache slots hold the pool's entries at the selected positions
        view = drafter.draft
        for layer, slots in retrieval.layout.items():
            pool_keys, _ = view.pool[layer]
            offsets = retrieval.selected[layer][slots.heads] - slots.start
            expected = pool_keys.gather(1, offsets[..., None].expand(-1, -1, pool_keys.shape[-1]))
            cached = view.runner.cache.layers[layer].keys[0, slots.heads, slots.slot:slots.slot + BUDGET]
            assert torch.equal(cached, expected)


def test_retrieval_every_other_round(vlm):
    target, close, plain = vlm
    config = DraftKVConfig("hybridkv", budget=BUDGET, retrieve_every=2, static_threshold=1.0, chunk=4)
    drafter = drafter_with("draft-model", target, close, config)
    assert Pipeline(target, drafter).generate(QUESTION, max_new_tokens=TOKENS, **VIDEO).token_ids == plain
    retrieval = drafter.draft.retrieval
    assert retrieval.retrievals == len(retrieval.layout) * (retrieval.rounds // 2) > 0


# --- refusals -----------------------------------------------------------------------------------------------


def test_a_text_only_draft_is_refused(vlm):
    from conftest import tiny_model

    target, _, _ = vlm
    text = LoadedModel(tiny_model("qwen2", seed=0, vocab_size=target.model.config.get_text_config().vocab_size),
                       target.tokenizer, "text")
    with pytest.raises(ValueError, match="text-only draft .* keeps none"):
        build_drafter("draft-model", target, text, 4, draft_kv="hybridkv")


@pytest.mark.parametrize("options, message", [
    (dict(draft_kv="snapkv"), "unknown draft KV policy"),
    (dict(draft_kv="topk", draft_kv_budget=0), "budget"),
    (dict(draft_kv="topk", draft_kv_budget=1.5), "fraction"),
    (dict(draft_kv="topk", retrieve_every=1), "needs the hybridkv policy"),
    (dict(retrieve_every=2), "needs draft_kv='hybridkv'"),
    (dict(draft_kv="hybridkv", retrieve_every=-1), "retrieve_every must be an integer >= 0"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        draft_kv_config(options.get("draft_kv"), options.get("draft_kv_budget"), options.get("retrieve_every", 0))


def test_bad_combinations_are_refused(vlm):
    target, close, _ = vlm
    with pytest.raises(ValueError, match="needs the hybridkv draft KV policy"):
        build_drafter("sparse", target, None, 4, draft_kv="topk", retrieve_every=1)
    with pytest.raises(ValueError, match="does not accept option 'draft_kv'"):
        build_drafter("prompt-lookup", target, None, 4, draft_kv="topk")
    with pytest.raises(ValueError, match="needs the hybridkv policy"):
        build_drafter("visual-prune", target, close, 4, draft_kv="mm-shiftkv", retrieve_every=1)


def test_cli_options_are_checked_before_loading():
    from sparrow.cli.generate import video_drafter_options
    from sparrow.drafters.plan import resolve_plan
    from sparrow.errors import UserError

    assert video_drafter_options(None, "hybridkv", 64, 2) == dict(
        draft_kv="hybridkv", draft_kv_budget=64, retrieve_every=2)
    assert video_drafter_options(0.5, "topk", None) == dict(drop_rate=0.5, draft_kv="topk", draft_kv_budget=None)
    for args, message in [((None, "topk", None, 1), "needs --draft-kv hybridkv"),
                          ((None, "hybridkv", None, 0), "integer >= 1"),
                          ((None, "h2o", None), "unknown --draft-kv")]:
        with pytest.raises(UserError, match=message):
            video_drafter_options(*args)
    with pytest.raises(UserError, match="sparse or visual-prune only"):  # the plan: the drafter takes the flag
        resolve_plan("no-such-model", drafter="prompt-lookup", flags=True, **video_drafter_options(None, "topk", None))


def test_cli_visual_prune_with_retrieval_is_lossless(tmp_path):
    import json

    from typer.testing import CliRunner
    from vlm_models import save_tiny_vlm, write_mp4

    from sparrow.cli import app

    directory = save_tiny_vlm("qwen2.5-vl", tmp_path / "tiny", seed=0)
    clip = write_mp4(tmp_path / "clip.mp4", moving_squares(16))
    result = CliRunner().invoke(app, [
        "generate", QUESTION, "--target", str(directory), "--drafter", "visual-prune", "--drop-rate", "0.5",
        "--draft-kv", "hybridkv", "--draft-kv-budget", "4", "--retrieve-every", "1", "--video", str(clip),
        "--frames", "16", "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "12", "-k", "4",
        "--compare", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["identical"] is True and record["drafter"] == "visual-prune"


@pytest.fixture(scope="module")
def saved_vlms(tmp_path_factory):
    """Both tiny VLM kinds saved as checkpoints, and a 16-frame clip: what the CLI loads."""
    from vlm_models import save_tiny_vlm, write_mp4

    root = tmp_path_factory.mktemp("saved-vlms")
    dirs = {kind: str(save_tiny_vlm(kind, root / kind, seed=0)) for kind in KINDS}
    return dirs, str(write_mp4(root / "clip.mp4", moving_squares(16)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("args", [
    ["--drafter", "draft-model", "--draft-kv", "mm-shiftkv", "--draft-quant", "w8a8"],
    ["--drafter", "visual-prune", "--drop-rate", "0.5", "--draft-kv", "hybridkv", "--draft-quant", "w8a8"],
    ["--drafter", "visual-prune", "--drop-rate", "0.5", "--draft-kv", "hybridkv", "--quant", "w8a8"],
], ids=["draft-model-w8a8-draft", "visual-prune-w8a8-draft", "visual-prune-w8a8-target"])
def test_cli_draft_kv_policies_run_on_row_wise_attention(saved_vlms, kind, args):
    """Regression (#31): a w8a8 copy attends row by row ("sparrow_rowwise"), which query capture refused, so
    `sparrow generate --draft-kv ...` exited 2 whenever the draft (or the target) ran w8a8 -- e.g. when
    --draft-quant auto picked w8a8 on the user's CPU. The CLI, as the user runs it, must now be lossless."""
    import json

    from typer.testing import CliRunner

    from sparrow.cli import app

    dirs, clip = saved_vlms
    result = CliRunner().invoke(app, [
        "generate", "What moves in this video?", "--target", dirs[kind], "--draft", dirs[kind], *args,
        "--video", clip, "--frames", "16", "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "16",
        "-k", "4", "--fixed", "--compare", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["identical"] is True, record
    assert record["stats"]["num_accepted_tokens"] > 0, record["stats"]
