"""Tree scoring, compaction and hidden states, on the target wrapper itself (float32 tiny models).

* every node of a tree scored in one forward (ancestor mask, depth positions) gets the logits its
  root-to-node path gets when fed as a chain;
* keeping an accepted path compacts the cache to what re-prefilling that path gives;
* hidden states handed out equal those of a plain forward over the same tokens.
Checked on Llama, Qwen2, Gemma-3 (sliding window 8, prompts longer than the window) and Qwen2.5-VL
(3-D M-RoPE positions after a video prompt), with sdpa and eager attention.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gemma3, tiny_model

from sparrow.decoding.engine import score
from sparrow.drafters.base import DrafterBase
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.runner import runner_for
from sparrow.tree import TreeLayout, ancestor_mask, chain_parents, depths, merge_paths, on_first_branch, path_to
from sparrow.types import Draft, Prompt

pytestmark = pytest.mark.usefixtures("one_thread")

PARENTS = torch.tensor([-1, -1, 0, 0, 2, 1, 5, 2])  # two branches off the root, a fork at node 0 and 2
ATOL = 1e-4


def test_layout_helpers():
    assert depths(PARENTS).tolist() == [1, 1, 2, 2, 3, 2, 3, 3]
    assert path_to(4, PARENTS).tolist() == [0, 2, 4]
    assert path_to(-1, PARENTS).tolist() == []
    assert on_first_branch(PARENTS, torch.tensor([0, 2, 4])) and on_first_branch(
        PARENTS, torch.tensor([], dtype=torch.long)
    )
    assert not on_first_branch(PARENTS, torch.tensor([1, 5])) and not on_first_branch(PARENTS, torch.tensor([0, 3]))
    mask = ancestor_mask(PARENTS)
    assert mask[4].nonzero().flatten().tolist() == [0, 2, 4]
    layout = TreeLayout.of(PARENTS, start=5)
    assert layout.positions.tolist() == [5, 6, 6, 7, 7, 8, 7, 8, 8]
    assert layout.mask.shape == (9, 5 + 9) and bool(layout.mask[:, :6].all())
    assert layout.mask[5, 5:].nonzero().flatten().tolist() == [0, 1, 3, 5]  # root, nodes 0, 2, 4
    chain = TreeLayout.of(chain_parents(4), start=2)
    assert torch.equal(chain.mask[:, 2:], torch.ones(5, 5, dtype=torch.bool).tril())
    tokens, parents = merge_paths([[5, 6, 7], [5, 8], [9]])
    assert tokens.tolist() == [5, 6, 7, 8, 9] and parents.tolist() == [-1, 0, 1, 0, -1]


def _models():
    return {
        "llama": lambda: tiny_model("llama", seed=0),
        "qwen2": lambda: tiny_model("qwen2", seed=0),
        "gemma3": lambda: tiny_gemma3(),
    }


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def text_model(request):
    return _models()[request.param]()


def _tree_tokens(seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (PARENTS.numel(),), generator=torch.Generator().manual_seed(seed))


def _check_tree_matches_chains(runner: CachedModel, prompt: Prompt, root: torch.Tensor, tokens: torch.Tensor):
    runner.prefill(prompt)
    start = runner.length
    out = score(runner, root, Draft(tokens, parents=PARENTS), ())
    assert out.logits.shape[0] == PARENTS.numel() + 1
    assert runner.length == start + PARENTS.numel() + 1
    for node in range(PARENTS.numel()):
        path = path_to(node, PARENTS)
        runner.rewind(start)
        chain = runner.forward(torch.cat([root, tokens[path]])).logits  # [depth + 1, vocab]
        torch.testing.assert_close(out.logits[node + 1], chain[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.logits[0], chain[0], atol=ATOL, rtol=0)


def _check_compaction(runner: CachedModel, prompt: Prompt, root: torch.Tensor, tokens: torch.Tensor):
    path = path_to(6, PARENTS)  # [1, 5, 6]: not the first branch
    runner.prefill(prompt)
    start = runner.length
    score(runner, root, Draft(tokens, parents=PARENTS), ())
    runner.keep(start, path)
    fresh = runner_for(runner.model)
    fresh.prefill(prompt)
    fresh.forward(torch.cat([root, tokens[path]]))
    fresh.rewind(fresh.length)  # as the engine does after every round: sliding layers back to their window
    assert runner.length == fresh.length == start + 1 + path.numel()
    for kept, ref in zip(runner.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(kept.keys, ref.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(kept.values, ref.values, atol=ATOL, rtol=0)
    nxt = torch.tensor([3])  # the next round continues identically from either cache
    torch.testing.assert_close(runner.forward(nxt).logits, fresh.forward(nxt).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("prompt_length", [5, 19])  # 19 > Gemma-3's window of 8
def test_tree_nodes_score_like_their_paths(text_model, attention, prompt_length):
    text_model.set_attn_implementation(attention)
    try:
        runner = CachedModel(text_model)
        ids = torch.randint(0, 300, (prompt_length,), generator=torch.Generator().manual_seed(prompt_length))
        _check_tree_matches_chains(runner, Prompt(ids), torch.tensor([7]), _tree_tokens(1, 300))
        _check_compaction(runner, Prompt(ids), torch.tensor([7]), _tree_tokens(2, 300))
    finally:
        text_model.set_attn_implementation("sdpa")


def test_hidden_states_equal_a_plain_forward(text_model):
    runner = CachedModel(text_model)
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3))
    layers = (0, 1, -1)
    pre = runner.prefill(Prompt(ids[:8]), hidden_layers=layers)
    out = runner.forward(ids[8:], hidden_layers=layers)
    with torch.inference_mode():
        ref = text_model(input_ids=ids[None], output_hidden_states=True)
    expected = torch.stack([ref.hidden_states[i][0] for i in layers])  # [3, 12, d]
    assert pre.hidden.shape == (3, 8, expected.shape[-1]) and out.hidden.shape == (3, 4, expected.shape[-1])
    torch.testing.assert_close(pre.hidden, expected[:, :8], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, expected[:, 8:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits, ref.logits[0, 8:], atol=ATOL, rtol=0)
    assert runner.forward(ids[:1]).hidden is None  # nothing asked, nothing computed


def test_rows_select_committed_outputs():
    runner = CachedModel(tiny_model("llama", seed=0))
    runner.prefill(Prompt(torch.tensor([1, 2, 3])))
    out = runner.forward(torch.tensor([4, 5, 6]), hidden_layers=(-1,))
    rows = out.rows(torch.tensor([0, 2]))
    assert torch.equal(rows.logits, out.logits[[0, 2]]) and torch.equal(rows.hidden, out.hidden[:, [0, 2]])


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    from vlm_models import moving_squares, save_tiny_vlm, write_mp4

    from sparrow.models import load_model
    from sparrow.pipeline import Pipeline

    root = tmp_path_factory.mktemp("tree-vl")
    target = load_model(str(save_tiny_vlm("qwen2.5-vl", root / "t", seed=0)), dtype="float32", device="cpu",
                        progress=False)
    video = str(write_mp4(root / "v.mp4", moving_squares(8, 64, 64), fps=4.0))
    prompt = Pipeline(target, None).encode("What moves?", video=video, frames=8)
    return target, prompt


def test_tree_on_mrope_video_model(qwen_vl):
    target, prompt = qwen_vl
    runner = runner_for(target.model)
    vocab = runner.vocab_size
    _check_tree_matches_chains(runner, prompt, torch.tensor([70]), _tree_tokens(3, min(vocab, 250)))
    _check_compaction(runner, prompt, torch.tensor([70]), _tree_tokens(4, min(vocab, 250)))
    assert runner.rope_delta < 0  # the video really shifted the text positions


class RecordingDrafter(DrafterBase):
    """A draft-model drafter (chain or tree) that asks for hidden states and records what the engine hands it."""

    name = "recording"
    hidden_layers = (1, -1)

    def __init__(self, inner) -> None:
        self.inner, self.prefilled, self.observed = inner, None, []
        self._committed = 0

    def prefill(self, prompt, target, out):
        self.prefilled = out
        self.inner.prefill(prompt, target, out)

    def propose(self, committed, max_tokens, sampling, generator):
        self._committed = committed.numel()
        return self.inner.propose(committed, max_tokens, sampling, generator)

    def observe(self, draft, verdict, out, step):
        self.observed.append((self._committed, verdict.num_accepted, out, step))
        self.inner.observe(draft, verdict, out, step)


@pytest.mark.parametrize("tree_budget", [0, 8])
def test_drafters_get_the_target_hidden_states_of_committed_rows(tree_budget, tokenizer):
    from conftest import perturbed

    from sparrow.drafters import build_drafter
    from sparrow.models import LoadedModel
    from sparrow.pipeline import Pipeline

    target = LoadedModel(tiny_model("qwen2", seed=0), tokenizer, "t")
    draft = LoadedModel(perturbed(target.model, 0.05, seed=1), tokenizer, "d")
    drafter = RecordingDrafter(build_drafter("draft-model", target, draft, 4, tree_budget=tree_budget))
    pipe = Pipeline(target, drafter)
    prompt = pipe.encode("The quick brown fox")
    result = pipe.generate("The quick brown fox", max_new_tokens=24)
    full = torch.cat([prompt.input_ids, torch.tensor(result.token_ids)])
    with torch.inference_mode():
        ref = target.model(input_ids=full[None], output_hidden_states=True)
    expected = torch.stack([ref.hidden_states[i][0] for i in RecordingDrafter.hidden_layers])  # [2, T, d]
    n = prompt.input_ids.numel()
    torch.testing.assert_close(drafter.prefilled.hidden, expected[:, :n], atol=ATOL, rtol=0)
    assert sum(accepted for _, accepted, _, _ in drafter.observed) > 0
    for committed, accepted, out, step in drafter.observed:
        rows = slice(committed - 1, committed + accepted)  # the root and the accepted path
        assert out.hidden.shape[1] == accepted + 1 and step.num_accepted == accepted
        torch.testing.assert_close(out.hidden, expected[:, rows], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.logits, ref.logits[0, rows], atol=ATOL, rtol=0)
        assert step.verify_seconds > 0 and step.draft_seconds >= 0
