"""The option matrix, through `sparrow.load` (what the CLI and the server call): for each model family (tiny random
Llama, Qwen2, Gemma-3, Qwen2.5-VL, LLaVA-OneVision), every registered drafter alone and with every option of
`sparrow.drafters.registry.OPTION_RULES` either runs exactly (float32 greedy == the pipeline's plain decoding,
drafts accepted where the drafter drafts) or is refused with a one-line UserError before any model loads: an option a
drafter does not take from the options alone, one the family cannot run from the family's config.json (the loader
replaced by a failure). Nothing is refused once the models are loaded. Cases come from the registry: a new drafter
or option joins by itself."""

from __future__ import annotations

import pytest
from conftest import tiny_gemma3, tiny_model
from vlm_models import byte_tokenizer, moving_squares, tiny_processor, tiny_vlm

import sparrow
import sparrow.loading
from sparrow.drafters.registry import OPTION_RULES, REGISTRY, OptionRule
from sparrow.errors import UserError
from sparrow.models import LoadedModel
from sparrow.vision.video import Video

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("llama", "qwen2", "gemma3", "qwen2.5-vl", "llava-onevision")
VLMS = ("qwen2.5-vl", "llava-onevision")
TOKENS = 10
MUST_ACCEPT = ("draft-model", "quantized-self", "auto")  # drafting with the target itself (or its copy)
DRAFTER_OPTIONS = {"layer-skip": {"skip_set": {"num_layers": 2, "mlp": [1]}}}  # tiny models ship no tuned set
CASES = [(drafter, rule) for drafter in REGISTRY for rule in (None, *OPTION_RULES)]
SLOW = {("qwen2", "compile")}  # torch.compile costs ~30 s a case; llama runs the same compiled code path


def family_cases(family: str) -> list:
    return [c for c in CASES if c[1] is None or (family, c[1].name) not in SLOW]


def case_id(case) -> str:
    drafter, rule = case
    return f"{drafter}+{rule.name if rule else 'plain'}"


@pytest.fixture(scope="module")
def family(request, tokenizer, tmp_path_factory):
    """(name, target, prompt options, a directory holding only the target's config.json); float32."""
    name = request.param
    if name in VLMS:
        tok = byte_tokenizer()
        target = LoadedModel(tiny_vlm(name, tok, seed=0), tok, name, tiny_processor(name, tok))
        media = {"video": Video.from_array(moving_squares(8)), "frames": 8}
    else:
        model = tiny_gemma3(num_layers=2) if name == "gemma3" else tiny_model(name, seed=0)
        target, media = LoadedModel(model, tokenizer, name), {}
    config_dir = tmp_path_factory.mktemp(name)
    target.model.config.save_pretrained(config_dir)  # what `read_config` reads; loading it would fail (no weights)
    return name, target, media, str(config_dir)


def one_line(error: BaseException) -> bool:
    text = str(error).strip()
    return bool(text) and "\n" not in text


class Loaded(Exception):
    """Raised by the replaced loader: sparrow.load got past its checks."""


def refusal_before_loading(drafter: str, rule: OptionRule | None, target: str = "matrix-target",
                           draft: str = "matrix-draft", **options) -> str | None:
    """The one-line error sparrow.load gives for (drafter, rule) on these model specs before it would load a model,
    or None where it goes on to load one. The default specs name no model: a decision from the options alone."""

    def no_loading(*args, **kwargs):
        raise Loaded

    patch = pytest.MonkeyPatch()
    patch.setattr(sparrow.loading, "load_model", no_loading)
    try:
        sparrow.load(target, drafter=drafter, draft=draft, **options, **(rule.load_options if rule else {}))
    except UserError as e:
        assert one_line(e), str(e)
        return str(e)
    except Loaded:
        return None
    finally:
        patch.undo()
    raise AssertionError("sparrow.load returned without loading a model")


@pytest.mark.parametrize(("family", "case"), [(f, c) for f in FAMILIES for c in family_cases(f)],
                         ids=[f"{f}-{case_id(c)}" for f in FAMILIES for c in family_cases(f)], indirect=["family"])
def test_every_drafter_and_option_runs_exactly_or_is_refused_before_loading(family, case):
    name, target, media, config_dir = family
    drafter, rule = case
    entry = REGISTRY[drafter]
    if rule is not None and not rule.applies(drafter):  # the registry says it does not apply: refused up front
        options = DRAFTER_OPTIONS.get(drafter, {})
        refused = refusal_before_loading(drafter, rule, **options)
        assert refused is not None, f"{drafter} with {rule.name} is not refused"
        assert refused != refusal_before_loading(drafter, None, **options), "refused, but not for the option"
        return
    options = {**DRAFTER_OPTIONS.get(drafter, {}), **(rule.load_options if rule is not None else {})}
    draft = entry.takes_draft_model
    refused = refusal_before_loading(drafter, None, config_dir, config_dir if draft else None, **options)
    if refused is not None:  # the family's config rules it out; the loaded family is refused the same way
        with pytest.raises(UserError) as error:
            sparrow.load(target, drafter=drafter, draft=target if draft else None, **options)
        assert str(error.value) == refused.replace(config_dir, name)
        print(f"MATRIX {name} {case_id(case)} refused before loading: {refused}")
        return
    pipe = sparrow.load(target, drafter=drafter, draft=target if draft else None, num_draft_tokens=3,
                        adaptive=False, **options)  # a UserError from here on is a refusal after loading: a failure
    result = pipe.generate("The quick brown fox", max_new_tokens=TOKENS, **media)
    stats = result.stats
    assert result.new_tokens == TOKENS and stats.num_accepted_tokens <= stats.num_draft_tokens
    if rule is not None and rule.lossy:
        return
    assert result.token_ids == pipe.generate_plain("The quick brown fox", max_new_tokens=TOKENS, **media).token_ids
    print(f"MATRIX {name} {case_id(case)} ran: accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens}")
    if drafter in MUST_ACCEPT and (rule is None or rule.name != "draft-vocab"):  # 64 tokens may miss the text
        assert stats.num_accepted_tokens > 0, (name, drafter, stats)
