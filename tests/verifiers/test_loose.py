"""Loose (LVSpec-style) verification: lossy, opt-in, labelled; unit rules and fidelity reporting."""

from __future__ import annotations

import pytest
import torch

from sparrow.config import SamplingConfig
from sparrow.types import Draft
from sparrow.verifiers import VERIFIERS, build_verifier
from sparrow.verifiers.loose import LooseVerifier, fidelity, filler_mask, is_filler_text

GREEDY = SamplingConfig()


def logits_from(rows: list[dict[int, float]], vocab: int = 10) -> torch.Tensor:
    """[len(rows), vocab] logits with the given probabilities (rest spread evenly)."""
    out = torch.full((len(rows), vocab), -30.0)
    for i, row in enumerate(rows):
        for t, p in row.items():
            out[i, t] = torch.tensor(p).log()
    return out


def test_loose_is_registered_lossy_and_never_auto():
    assert VERIFIERS["loose"] is LooseVerifier and LooseVerifier.lossy is True
    assert isinstance(build_verifier("loose", GREEDY), LooseVerifier)
    for sampling in (GREEDY, SamplingConfig(temperature=0.7)):
        chosen = build_verifier("auto", sampling)
        assert not getattr(chosen, "lossy", False) and chosen.name != "loose"
    for name in ("greedy", "rejection"):
        assert not getattr(VERIFIERS[name], "lossy", False)


def test_pipeline_default_verifier_is_lossless():
    import inspect

    from sparrow.drafters.plan import resolve_plan
    from sparrow.pipeline import Pipeline

    assert inspect.signature(resolve_plan).parameters["verifier"].default == "auto"  # what sparrow.load takes
    assert resolve_plan("no-such-model", drafter="prompt-lookup").verifier == "auto"
    assert inspect.signature(Pipeline).parameters["verifier"].default == "auto"


def test_fillers_loose_anchors_strict():
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[1, 2]] = True  # tokens 1, 2 are fillers
    v = LooseVerifier(filler_mask=mask, top_m=2, min_ratio=0.3, shift_window=0)
    rows = [{0: 0.6, 1: 0.4}, {3: 0.6, 4: 0.4}, {5: 1.0}]
    # filler 1 in top-2 with ratio 0.67 -> accepted; anchor 4 is not the argmax -> rejected, target's 3 instead
    verdict = v.verify(Draft(torch.tensor([1, 4])), logits_from(rows), GREEDY, None)
    assert verdict.num_accepted == 1 and verdict.tokens.tolist() == [1, 3]
    # the same filler below the probability ratio is rejected
    rows_low = [{0: 0.8, 1: 0.2}, {3: 1.0}]
    verdict = v.verify(Draft(torch.tensor([1])), logits_from(rows_low), GREEDY, None)
    assert verdict.num_accepted == 0 and verdict.tokens.tolist() == [0]
    # all accepted -> bonus token from the last row
    verdict = v.verify(Draft(torch.tensor([1, 3])), logits_from(rows), GREEDY, None)
    assert verdict.num_accepted == 2 and verdict.tokens.tolist() == [1, 3, 5]


def test_position_shift_tolerance():
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[1, 2]] = True
    rows = [{0: 0.9, 2: 0.1}, {2: 0.95, 6: 0.05}, {7: 1.0}]  # the target says filler 2 one position later
    strict = LooseVerifier(filler_mask=mask, top_m=1, shift_window=0)
    shifted = LooseVerifier(filler_mask=mask, top_m=1, shift_window=1)
    draft = Draft(torch.tensor([2, 2]))
    assert strict.verify(draft, logits_from(rows), GREEDY, None).num_accepted == 0
    assert shifted.verify(draft, logits_from(rows), GREEDY, None).num_accepted == 2


def test_exact_match_always_accepted_and_reduces_to_greedy_for_anchors():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    choice = logits.argmax(-1)
    v = LooseVerifier(filler_mask=torch.zeros(50, dtype=torch.bool))  # no fillers: strict everywhere
    verdict = v.verify(Draft(choice[:5].clone()), logits, GREEDY, None)
    assert verdict.num_accepted == 5 and verdict.tokens.tolist() == choice.tolist()
    wrong = choice[:5].clone()
    wrong[2] = (wrong[2] + 1) % 50
    greedy = build_verifier("greedy", GREEDY).verify(Draft(wrong), logits, GREEDY, None)
    loose = v.verify(Draft(wrong), logits, GREEDY, None)
    assert loose.tokens.tolist() == greedy.tokens.tolist()


def test_filler_text_and_mask(tokenizer):
    assert is_filler_text(" the") and is_filler_text(",") and is_filler_text("  ") and is_filler_text(" Of")
    assert not is_filler_text(" red") and not is_filler_text("dog") and not is_filler_text("3")
    mask = filler_mask(tokenizer, 320)
    assert mask.dtype == torch.bool and mask.shape == (320,) and 0 < int(mask.sum()) < 320
    assert not mask[tokenizer.eos_token_id]


def test_bad_options_raise():
    with pytest.raises(ValueError, match="top_m"):
        LooseVerifier(top_m=0)
    with pytest.raises(ValueError, match="min_ratio"):
        LooseVerifier(min_ratio=2.0)
    with pytest.raises(ValueError, match="shift_window"):
        LooseVerifier(shift_window=-1)


def test_fidelity_report():
    f = fidelity([[1, 2, 3], [1, 2, 4, 5]], [[1, 2, 3], [1, 9, 4, 5]])
    assert f.identical == 0.5 and f.samples == 2
    assert f.token_agreement == pytest.approx(6 / 7)
    assert f.prefix_agreement == pytest.approx((1.0 + 0.25) / 2)
    assert fidelity([[1]], [[1]]).to_dict()["identical"] == 1.0
    with pytest.raises(ValueError, match="same length"):
        fidelity([[1]], [])


# --- through the pipeline and the CLI ----------------------------------------------------------------------

from conftest import perturbed  # noqa: E402

from sparrow.drafters import build_drafter  # noqa: E402
from sparrow.models import LoadedModel  # noqa: E402
from sparrow.pipeline import Pipeline  # noqa: E402

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]


pytestmark = pytest.mark.usefixtures("one_thread")


def test_loose_pipeline_accepts_at_least_strict_and_reports_fidelity(loaded_target, tokenizer):
    draft = LoadedModel(perturbed(loaded_target.model, 0.1, seed=1), tokenizer, "close")
    strict_pipe = Pipeline(loaded_target, build_drafter("draft-model", loaded_target, draft, 4))
    loose_pipe = Pipeline(loaded_target, build_drafter("draft-model", loaded_target, draft, 4), "loose")
    strict, loose, plain = [], [], []
    accepted = {"strict": 0, "loose": 0}
    for prompt in PROMPTS:
        s = strict_pipe.generate(prompt, max_new_tokens=30)
        lo = loose_pipe.generate(prompt, max_new_tokens=30)
        plain.append(strict_pipe.generate_plain(prompt, max_new_tokens=30).token_ids)
        strict.append(s.token_ids)
        loose.append(lo.token_ids)
        accepted["strict"] += s.stats.num_accepted_tokens
        accepted["loose"] += lo.stats.num_accepted_tokens
        assert len(lo.token_ids) == 30
    assert strict == plain  # the lossless path is untouched
    assert accepted["loose"] > 0
    f = fidelity(loose, plain)
    assert 0.0 <= f.identical <= 1.0 and 0.0 < f.token_agreement <= 1.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, loaded_target):
    path = tmp_path_factory.mktemp("tiny-model-loose")
    loaded_target.model.save_pretrained(path)
    loaded_target.tokenizer.save_pretrained(path)
    return str(path)


def cli(*args: str):
    from typer.testing import CliRunner

    from sparrow.cli import app

    return CliRunner().invoke(app, list(args))


def test_cli_loose_is_labelled_lossy(model_dir):
    import json

    result = cli("generate", "The quick brown fox", "--target", model_dir, "--drafter", "draft-model", "--draft",
                 model_dir, "--dtype", "float32", "--max-new-tokens", "8", "-k", "4", "--verify", "loose", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["lossy"] is True and record["verifier"] == "loose" and record["lossless_relative_to"] is None
    plain = json.loads(cli("generate", "The quick brown fox", "--target", model_dir, "--drafter", "draft-model",
                           "--draft", model_dir, "--dtype", "float32", "--max-new-tokens", "8", "--json").stdout)
    assert "lossy" not in plain and plain["lossless_relative_to"] == "the target"


@pytest.mark.parametrize(("args", "match"), [
    (["--verify", "sloppy"], "unknown verifier"),
    (["--drop-rate", "0.5"], "--drop-rate applies to --drafter visual-prune"),
    (["--drafter", "visual-prune", "--drop-rate", "1.5"], "--drop-rate must be in [0, 1)"),
    (["--drafter", "prompt-lookup", "--draft-kv", "mm-shiftkv"], "draft-model, sparse or visual-prune only"),
    (["--drafter", "sparse", "--draft-kv", "snapkv"], "unknown --draft-kv"),
    (["--drafter", "sparse", "--draft-kv-budget", "0"], "--draft-kv-budget"),
])
def test_cli_video_option_errors(args, match):
    result = cli("generate", "hi", "--target", "llama-9000", *args)
    assert result.exit_code == 2 and match in result.output and "Traceback" not in result.output, result.output


def test_build_verifier_with_a_tokenizer_uses_the_filler_mask(tokenizer):
    verifier = build_verifier("loose", GREEDY, tokenizer=tokenizer)
    assert isinstance(verifier, LooseVerifier) and verifier.filler_mask is not None
    assert verifier.filler_mask.numel() == len(tokenizer)
