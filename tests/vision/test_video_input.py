"""Video/image input: uniform frame sampling, PyAV and frame-directory reading with real timing, and clear
errors (ValueError naming the argument in the API, one `error:` line from the CLI)."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
from conftest import tiny_model
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner
from vlm_models import moving_squares, save_tiny_vlm, write_frame_dir, write_mp4

from sparrow.cli import app
from sparrow.models import LoadedModel, load_model
from sparrow.pipeline import Pipeline
from sparrow.vision import Video, read_video, sample_indices


@given(total=st.integers(1, 5000), frames=st.integers(1, 300))
def test_sampling_is_uniform_and_returns_n_frames(total, frames):
    indices = sample_indices(total, frames)
    n = min(frames, total)
    assert len(indices) == n and len(set(indices)) == n
    assert list(indices) == sorted(indices) and 0 <= indices[0] and indices[-1] < total
    gaps = np.diff([-1, *indices]) if n == 1 else np.diff(indices)
    assert gaps.max() - gaps.min() <= 1  # evenly spaced up to rounding
    assert abs((indices[0] + indices[-1]) / 2 - (total - 1) / 2) <= 1  # centred: no bias to either end


def test_sample_indices_example():
    assert sample_indices(10, 4) == (1, 3, 6, 8)
    assert sample_indices(3, 8) == (0, 1, 2)  # never more frames than the video has


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("video-input")
    frames = moving_squares(16, 64, 64)
    (root / "broken.mp4").write_bytes(b"this is not a video")
    (root / "empty").mkdir()
    (root / "texts").mkdir()
    (root / "texts" / "a.txt").write_text("no frames here")
    from PIL import Image

    Image.fromarray(frames[0]).save(root / "image.png")
    return {"frames": frames, "mp4": str(write_mp4(root / "clip.mp4", frames, fps=8.0)),
            "dir": str(write_frame_dir(root / "frames", frames)), "root": root, "image": str(root / "image.png")}


def test_mp4_is_sampled_uniformly_with_its_real_timing(files):
    video = read_video(files["mp4"], frames=4)
    assert video.frames.shape == (4, 64, 64, 3) and video.frames.dtype == np.uint8
    assert video.indices == (2, 6, 10, 14) and video.total_frames == 16 and video.fps == 8.0
    error = np.abs(video.frames.astype(float) - files["frames"][list(video.indices)].astype(float)).mean()
    assert error < 10  # lossy codec, same frames
    meta = video.metadata()
    assert meta.sampled_fps == pytest.approx(2.0)  # 4 of 16 frames at 8 fps


def test_frame_directory_is_sampled_in_name_order(files):
    video = read_video(files["dir"], frames=5)
    assert video.indices == sample_indices(16, 5)
    assert np.array_equal(video.frames, files["frames"][list(video.indices)])  # PNG is lossless
    assert read_video(files["dir"], frames=100).frames.shape[0] == 16


def test_subsampling_a_video_keeps_its_source_timing(files):
    video = read_video(files["mp4"], frames=8).subsample(4)
    assert video.indices == (3, 7, 11, 15)  # of source frames (1, 3, ..., 15)
    assert video.total_frames == 16 and video.metadata().sampled_fps == pytest.approx(2.0)


def test_array_input_keeps_all_frames_unless_asked():
    frames = moving_squares(6)
    assert Video.from_array(frames).frames.shape[0] == 6
    assert Video.from_array(frames, num_frames=3).indices == sample_indices(6, 3)


@pytest.mark.parametrize(("name", "frames", "match"), [
    ("missing.mp4", 8, "video: no such file"),
    ("broken.mp4", 8, "video: cannot read"),
    ("empty", 8, "video: .* holds no frame images"),
    ("texts", 8, "video: .* holds no frame images"),
    ("clip.mp4", 0, "frames must be an integer >= 1"),
    ("clip.mp4", -2, "frames must be an integer >= 1"),
    ("clip.mp4", True, "frames must be an integer >= 1"),
])
def test_read_video_errors_name_the_argument(files, name, frames, match):
    with pytest.raises(ValueError, match=match):
        read_video(files["root"] / name, frames=frames)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return str(save_tiny_vlm("qwen2.5-vl", tmp_path_factory.mktemp("qwen"), seed=0))


@pytest.fixture(scope="module")
def vlm(vlm_dir) -> LoadedModel:
    return load_model(vlm_dir, dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def text_model(tokenizer) -> LoadedModel:
    return LoadedModel(tiny_model("llama", seed=0), tokenizer, "tiny-llama")


@pytest.mark.parametrize(("options", "match"), [
    ({"video": "clip.mp4", "frames": 0}, "frames must be"),
    ({"frames": 4}, "frames: given without a video"),
    ({"video": "missing.mp4"}, "video: no such file"),
    ({"video": "broken.mp4"}, "video: cannot read"),
    ({"video": "empty"}, "video: .* no frame images"),
    ({"image": "missing.png"}, "image: no such file"),
    ({"image": "broken.mp4"}, "image: cannot read"),
])
def test_bad_media_requests_raise_value_error(vlm, files, options, match):
    options = {k: str(files["root"] / v) if isinstance(v, str) else v for k, v in options.items()}
    with pytest.raises(ValueError, match=match):
        Pipeline(vlm, None).request("What moves?", **options)


@pytest.mark.parametrize("option", ["video", "image"])
def test_media_for_a_text_only_model_is_refused(text_model, files, option):
    with pytest.raises(ValueError, match=f"{option}: target 'tiny-llama' is a text-only model"):
        Pipeline(text_model, None).request("What moves?", **{option: files["mp4" if option == "video" else "image"]})


def test_video_for_a_processor_without_video_support_is_refused(vlm, files):
    processor = copy.copy(vlm.processor)
    processor.video_processor = None
    images_only = LoadedModel(vlm.model, vlm.tokenizer, "images-only", processor)
    with pytest.raises(ValueError, match="video: .* has no video support"):
        Pipeline(images_only, None).request("What moves?", video=files["mp4"])
    Pipeline(images_only, None).request("What is it?", image=files["image"])  # images still work


def test_text_prompts_still_work_on_a_vlm(vlm):
    result = Pipeline(vlm, None).generate_plain("Hello", max_new_tokens=5)
    assert result.new_tokens == 5


def cli(*args: str):
    return CliRunner().invoke(app, ["generate", *args])


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory, text_model):
    path = tmp_path_factory.mktemp("text-model")
    text_model.model.save_pretrained(path)
    text_model.tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(("args", "match"), [
    (["--video", "{root}/clip.mp4", "--frames", "0"], "frames must be an integer >= 1"),
    (["--frames", "4"], "frames: given without a video"),
    (["--video", "{root}/missing.mp4"], "video: no such file"),
    (["--video", "{root}/broken.mp4"], "video: cannot read"),
    (["--video", "{root}/empty"], "no frame images"),
    (["--image", "{root}/missing.png"], "image: no such file"),
    (["--target", "{text}", "--video", "{root}/clip.mp4"], "video: target .* is a text-only model"),
    (["--target", "{text}", "--image", "{root}/image.png"], "image: target .* is a text-only model"),
])
def test_cli_media_errors_are_one_line(vlm_dir, text_dir, files, args, match, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = [a.format(root=files["root"], text=text_dir) for a in args]
    if "--target" not in args:
        args += ["--target", vlm_dir]
    result = cli("What moves?", "--drafter", "prompt-lookup", "--dtype", "float32", *args)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(match, errors[0]), result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("source", ["mp4", "dir"])
def test_cli_generates_from_a_video_losslessly(vlm_dir, files, source):
    result = cli("What moves?", "--target", vlm_dir, "--drafter", "draft-model", "--draft", vlm_dir,
                 "--dtype", "float32", "--video", files[source], "--frames", "4", "--max-new-tokens", "12",
                 "-k", "4", "--fixed", "--compare", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["identical"] is True and record["new_tokens"] == 12
    assert record["acceptance_rate"] == 1.0  # draft == target


def test_cli_generates_from_images(vlm_dir, files):
    result = cli("What is it?", "--target", vlm_dir, "--drafter", "prompt-lookup", "--dtype", "float32",
                 "--image", files["image"], "--image", files["image"], "--max-new-tokens", "8", "--compare", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["identical"] is True


def test_arrays_and_video_objects_are_accepted(vlm, files):
    pipe = Pipeline(vlm, None)
    video_token = vlm.model.config.video_token_id
    from_array = pipe.encode("What moves?", video=moving_squares(8))
    from_object = pipe.encode("What moves?", video=read_video(files["mp4"], 16), frames=8)
    assert int((from_array.input_ids == video_token).sum()) == int((from_object.input_ids == video_token).sum()) == 16
    assert from_object.model_inputs["second_per_grid_ts"].tolist() == pytest.approx([0.5])  # 8 of 16 at 8 fps: 4 fps
