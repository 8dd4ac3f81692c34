"""Video-LLM targets are lossless: greedy speculative output == plain greedy output on videos and images
(tiny random float32 Qwen2.5-VL with 3-D M-RoPE, and LLaVA-OneVision), drafts are accepted, and
verification runs at exactly the position ids plain decoding uses, which are transformers' own."""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
from vlm_models import KINDS, moving_squares, perturbed, save_tiny_vlm, write_frame_dir, write_mp4

from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel, load_model
from sparrow.pipeline import Pipeline
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.runner import runner_for
from sparrow.vision import MRopeCachedModel, VisionCachedModel, read_video, visual_token_positions

QUESTION = "What moves in the video?"
NEW_TOKENS = 40


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    frames = moving_squares(8, 64, 64)
    from PIL import Image

    Image.fromarray(moving_squares(1, 64, 64)[0]).save(root / "image.png")
    return {"mp4": str(write_mp4(root / "video.mp4", frames, fps=4.0)),
            "frames": str(write_frame_dir(root / "frames", frames)), "image": str(root / "image.png")}


@pytest.fixture(scope="module", params=KINDS)
def models(request, tmp_path_factory) -> dict[str, LoadedModel]:
    """target, "close" (perturbed copy) and "other" (another seed), all saved and reloaded via load_model."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    target_dir = save_tiny_vlm(kind, root / "target", seed=0)
    load = lambda d: load_model(str(d), dtype="float32", device="cpu", progress=False)  # noqa: E731
    target = load(target_dir)
    close_dir = save_tiny_vlm(kind, root / "close", model=perturbed(target.model, 0.03, seed=1))
    other_dir = save_tiny_vlm(kind, root / "other", seed=7)
    return {"kind": kind, "target": target, "close": load(close_dir), "other": load(other_dir)}


def media_options(source: str, media: dict[str, str]) -> dict:
    if source == "image":
        return {"image": media["image"]}
    return {"video": media[source], "frames": 8}


class PositionRecorder:
    """Wraps a CachedModel's position_ids hook; maps cache index -> position ids used for it."""

    def __init__(self, runner: CachedModel) -> None:
        self.inner = runner.position_ids
        self.seen: dict[int, list[tuple[int, ...]]] = defaultdict(list)
        runner.position_ids = self

    def __call__(self, positions: torch.Tensor):
        ids = self.inner(positions)  # [3, 1, n] (M-RoPE) or [1, n]
        for i, index in enumerate(positions.tolist()):
            self.seen[index].append(tuple(ids[..., i].flatten().tolist()))
        return ids


def test_loader_returns_a_vlm_with_its_processor(models):
    target = models["target"]
    assert target.is_vlm and target.processor is not None and target.tokenizer is target.processor.tokenizer
    expected = MRopeCachedModel if models["kind"] == "qwen2.5-vl" else VisionCachedModel
    runner = runner_for(target.model)
    assert type(runner) is expected and type(copy.deepcopy(runner)) is expected


@pytest.mark.parametrize("source", ["mp4", "frames", "image"])
def test_plain_decoding_equals_transformers_generate(models, media, source):
    """The oracle itself: our prefill + cached decode (explicit M-RoPE positions) == HF greedy generate."""
    pipe = Pipeline(models["target"], None)
    prompt = pipe.encode(QUESTION, **media_options(source, media))
    inputs = {"input_ids": prompt.input_ids[None], **prompt.model_inputs}
    with torch.no_grad():
        hf = models["target"].model.generate(**inputs, max_new_tokens=20, do_sample=False,
                                             eos_token_id=pipe.tokenizer.eos_token_id)
    ours = pipe.generate_plain(QUESTION, max_new_tokens=20, **media_options(source, media)).token_ids
    assert ours == hf[0, prompt.input_ids.numel():].tolist()


@pytest.mark.parametrize("source", ["mp4", "frames", "image"])
@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
def test_speculative_equals_plain_at_the_same_positions(models, media, source, drafter):
    target = models["target"]
    options = dict(max_new_tokens=NEW_TOKENS, **media_options(source, media))
    plain_pipe = Pipeline(target, None)
    plain_positions = PositionRecorder(plain_pipe.runner)
    plain = plain_pipe.generate_plain(QUESTION, **options)
    assert plain.new_tokens == NEW_TOKENS
    drafted = accepted = 0
    for draft, k in ((models["close"], 4), (target, 3)) if drafter == "draft-model" else ((None, 4), (None, 8)):
        pipe = Pipeline(target, build_drafter(drafter, target, draft, k))
        positions = PositionRecorder(pipe.runner)
        result = pipe.generate(QUESTION, **options)
        assert result.token_ids == plain.token_ids, (drafter, k, result.stats)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
        # Every token verified (re-fed after a rejection included) sat at plain decoding's position.
        assert positions.seen.keys() <= plain_positions.seen.keys()
        for index, used in positions.seen.items():
            assert set(used) == set(plain_positions.seen[index]), index
    assert accepted > 0 and drafted > 0


def test_positions_are_transformers_own_and_ignore_stale_model_state(models, media):
    """Decode positions = cache index + the rope delta HF's own prefill computes; a stale
    model.model.rope_deltas (another sequence, or a draft of the same class) changes nothing."""
    if models["kind"] != "qwen2.5-vl":
        pytest.skip("LLaVA-OneVision uses plain 1-D positions")
    target = models["target"]
    pipe = Pipeline(target, None)
    prompt = pipe.encode(QUESTION, video=media["mp4"], frames=8)
    with torch.no_grad():  # HF's own path: the prefill derives and stores rope_deltas on the model
        target.model(input_ids=prompt.input_ids[None], **prompt.model_inputs)
    hf_delta = int(target.model.model.rope_deltas)
    runner = runner_for(target.model)
    runner.prefill(prompt)
    assert runner.rope_delta == hf_delta < 0  # visual tokens share positions: text resumes below its index
    n = prompt.input_ids.numel()
    assert runner.position_ids(torch.arange(n, n + 3))[:, 0].tolist() == [[n + hf_delta + i for i in range(3)]] * 3
    temporal = runner.prompt_positions[0, 0, visual_token_positions(prompt, target.model.config, "video")]
    assert temporal.unique().numel() == 4  # 4 temporal patches at distinct times (real fps metadata)
    expected = pipe.generate_plain(QUESTION, max_new_tokens=20, video=media["mp4"]).token_ids
    target.model.model.rope_deltas = torch.tensor([[123]])
    assert pipe.generate_plain(QUESTION, max_new_tokens=20, video=media["mp4"]).token_ids == expected
    other = models["other"]  # a draft of the same class, prefilled between the target's steps
    spec = Pipeline(target, build_drafter("draft-model", target, other, 4)).generate(
        QUESTION, max_new_tokens=20, video=media["mp4"])
    assert spec.token_ids == expected


def test_sampling_with_a_vlm_draft_is_reproducible(models, media):
    target = models["target"]
    pipe = Pipeline(target, build_drafter("draft-model", target, models["close"], 4))
    runs = [pipe.generate(QUESTION, max_new_tokens=20, temperature=0.8, seed=3, video=media["mp4"]).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_frame_directory_and_mp4_agree_on_frame_count(media):
    assert read_video(media["mp4"], 4).frames.shape[0] == read_video(media["frames"], 4).frames.shape[0] == 4
