"""`sparrow train head --arch sparrow`: a Sparrow head for a Video-LLM target, trained from the command line.

a) On a tiny random Qwen2.5-VL (videos: a directory of .mp4 files) and LLaVA-OneVision (no --videos: the default,
   opencv-doc's sample directory, pointed at a tmp dir holding a vtest.avi and a tree.avi) the CLI answers each
   (video, question) pair with the target, trains, and writes a head: the training loss falls, the held-out pairs
   (never trained on) are evaluated and their top-1 agreement rises; the head loads with `--drafter eagle --head
   DIR` and float32 speculative output equals plain greedy output, with drafts accepted.
b) Resume (videos: an .mp4 and a directory of frame images; a gated 2-layer head): a run stopped after 3 steps and
   resumed to 6 ends with the weights and log of an uninterrupted run, reusing the target's answers
   (video_corpus.json); an expired time budget stops cleanly and a rerun continues.
c) Refusals, before any model loads: a text-only target (named: --target, what was expected), the text corpus'
   options with --arch sparrow, the video options without it, missing videos, no default videos.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer
from safetensors.torch import load_file
from typer.testing import CliRunner
from vlm_models import moving_squares, save_tiny_vlm, write_frame_dir, write_mp4

from sparrow.cli import app
from sparrow.training.trainer import read_log

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = ["--dtype", "float32", "--device", "cpu", "--no-progress", "--frames", "4", "--distill-tokens", "24",
          "--text-window", "16", "--batch-size", "2", "--lr", "3e-3", "--held-out-percent", "20"]


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sparrow-videos")
    (root / "clips").mkdir()
    write_mp4(root / "clips" / "a.mp4", moving_squares(8), fps=4.0)
    write_mp4(root / "clips" / "b.mp4", moving_squares(12, 48, 64)[::-1].copy(), fps=4.0)
    (root / "opencv").mkdir()
    write_mp4(root / "opencv" / "vtest.avi", moving_squares(10, 64, 48), fps=5.0)  # names opencv-doc ships
    write_mp4(root / "opencv" / "tree.avi", moving_squares(8, 48, 48)[:, ::-1].copy(), fps=4.0)
    write_frame_dir(root / "frames", moving_squares(6, 64, 64)[:, :, ::-1].copy())
    return {"clips": root / "clips", "opencv": root / "opencv", "frames": root / "frames",
            "a": root / "clips" / "a.mp4"}


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sparrow-targets")
    text = root / "text"
    tiny_model("llama", seed=0).save_pretrained(text)
    tiny_tokenizer().save_pretrained(text)
    return {"qwen2.5-vl": save_tiny_vlm("qwen2.5-vl", root / "qwen", seed=0),
            "llava-onevision": save_tiny_vlm("llava-onevision", root / "llava", seed=0), "text": text}


@pytest.fixture()
def offline(monkeypatch, media):
    import sparrow.training.video_data as video_data

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(video_data, "OPENCV_SAMPLES", media["opencv"])


def train(out: Path, target: Path, *args: str) -> tuple[dict, str]:
    result = CliRunner().invoke(app, ["train", "head", "--out", str(out), "--target", str(target), "--arch", "sparrow",
                                      *COMMON, *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1]), result.output


# a) training, held-out evaluation, lossless decoding -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen2.5-vl", "llava-onevision"])
def test_cli_trains_a_sparrow_head_that_decodes_losslessly(kind, targets, media, offline, tmp_path):
    import sparrow
    from sparrow.drafters import build_drafter
    from sparrow.pipeline import Pipeline
    from sparrow.vision.video import read_video

    out = tmp_path / "run"
    # Qwen2.5-VL: a directory of video files; LLaVA-OneVision: no --videos, the default (OPENCV_SAMPLES' videos)
    videos = ["--videos", str(media["clips"])] if kind == "qwen2.5-vl" else []
    report, output = train(out, targets[kind], *videos, "--steps", "100", "--eval-every", "10")
    expected = ([str(media["clips"] / "a.mp4"), str(media["clips"] / "b.mp4")] if kind == "qwen2.5-vl"
                else [str(media["opencv"] / "vtest.avi"), str(media["opencv"] / "tree.avi")])
    assert report["arch"] == "sparrow" and report["videos"] == [str(Path(v).resolve()) for v in expected]
    pairs = len(report["videos"]) * len(report["questions"])
    held = report["held_out_pairs"]
    assert report["held_out_sequences"] == len(held) >= 1 and report["train_sequences"] == pairs - len(held)
    assert report["steps"] == 100 and report["text_window"] == 16 and report["frames"] == 4
    for name in ("config.json", "model.safetensors", "trainer_state.pt", "train_log.jsonl", "eval.json",
                 "training.png", "video_corpus.json", "run.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["sparrow"]["text_window"] == 16
    corpus = json.loads((out / "video_corpus.json").read_text())
    assert len(corpus["answers"]) == pairs and all(len(a["answer"]) == 24 for a in corpus["answers"])
    assert sorted((a["video"], a["question"]) for a in corpus["answers"] if a["held_out"]) == \
        sorted((h["video"], h["question"]) for h in held)

    rows = read_log(out / "train_log.jsonl")
    losses = [r["loss"] for r in rows]
    assert sum(losses[-10:]) < sum(losses[:10]) - 5, losses  # the mean loss falls by > 0.5
    evals = [r for r in rows if "held_out_loss" in r]
    assert [r["step"] for r in evals] == list(range(10, 101, 10))
    assert evals[-1]["held_out_loss"] < evals[0]["held_out_loss"]
    assert evals[-1]["held_out_agreement"][0] > evals[0]["held_out_agreement"][0] + 0.1, [
        (r["held_out_loss"], r["held_out_agreement"]) for r in evals]
    assert report["held_out"]["agreement_per_depth"] == pytest.approx(evals[-1]["held_out_agreement"])
    assert len(report["held_out"]["agreement_per_depth"]) == 3
    assert "top-1 agreement by depth" in output and f"--drafter eagle --head {out}" in output

    loaded = sparrow.load(str(targets[kind]), drafter="eagle", head=str(out), dtype="float32", device="cpu",
                          progress=False)  # what --drafter eagle --head DIR builds
    assert type(loaded.drafter).__name__ == "SparrowDrafter"
    plain = Pipeline(loaded.target, None)
    pipe = Pipeline(loaded.target, build_drafter("eagle", loaded.target, None, 4, head=str(out)))  # 4 drafts a round
    accepted = 0
    for source in report["videos"]:
        video = read_video(source, 4)
        for question in (*report["questions"][:2], "What colour is the square?"):  # two trained on, one not
            result = pipe.generate(question, max_new_tokens=30, video=video)
            assert result.token_ids == plain.generate_plain(question, max_new_tokens=30, video=video).token_ids
            accepted += result.stats.num_accepted_tokens
    assert accepted > 0

    result = CliRunner().invoke(app, ["generate", "What moves?", "--target", str(targets[kind]), "--dtype", "float32",
                                      "--device", "cpu", "--video", report["videos"][0], "--frames", "4",
                                      "--max-new-tokens", "16", "--drafter", "eagle", "--head", str(out), "--compare",
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["identical"] is True


# b) resume and time budget ---------------------------------------------------------------------------------------


def test_cli_sparrow_resume_matches_an_uninterrupted_run(targets, media, offline, tmp_path):
    target = targets["qwen2.5-vl"]
    args = ["--videos", str(media["a"]), "--videos", str(media["frames"]), "--checkpoint-every", "2",
            "--eval-every", "3", "--fusion", "gated", "--layers", "2"]  # Dovetail's shape options apply too
    whole, part = tmp_path / "whole", tmp_path / "part"
    train(whole, target, *args, "--steps", "6")
    first, _ = train(part, target, *args, "--steps", "3")
    assert first["steps"] == 3 and "answer_seconds" in first
    resumed = CliRunner().invoke(app, ["train", "head", "--out", str(part), "--no-progress", "--resume",
                                       "--steps", "6"])
    assert resumed.exit_code == 0, resumed.output
    report = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert report["steps"] == 6 and report["arch"] == "sparrow" and report["held_out"]["agreement_per_depth"]
    assert "answer_seconds" not in report  # the answers were reused, not generated again
    weights = load_file(str(whole / "model.safetensors"))
    resumed_weights = load_file(str(part / "model.safetensors"))
    assert weights.keys() == resumed_weights.keys()
    for name, tensor in resumed_weights.items():
        assert torch.equal(tensor, weights[name]), name
    assert read_log(whole / "train_log.jsonl") == read_log(part / "train_log.jsonl")
    config = json.loads((part / "config.json").read_text())
    assert config["fusion"] == "gated" and config["num_hidden_layers"] == 2 and config["sparrow"]["text_window"] == 16

    for extra, message in ((["--videos", str(media["a"])], "--videos would need a new run"),
                           (["--arch", "eagle3"], "--resume continues the run's head (--arch sparrow)"),
                           (["--tokens", "100"], "--tokens applies to the text corpus")):
        refused = CliRunner().invoke(app, ["train", "head", "--out", str(part), "--resume", *extra])
        assert refused.exit_code == 2 and message in refused.output, refused.output


def test_cli_sparrow_time_budget_stops_cleanly_and_a_rerun_continues(targets, media, offline, tmp_path):
    out, target = tmp_path / "run", targets["qwen2.5-vl"]
    args = ["--videos", str(media["a"]), "--steps", "4"]
    stopped = CliRunner().invoke(app, ["train", "head", "--out", str(out), "--target", str(target), "--arch",
                                       "sparrow", *COMMON, *args, "--time-budget", "0.001"])
    assert stopped.exit_code == 0 and "time budget spent while the target answered" in stopped.output, stopped.output
    assert not (out / "trainer_state.pt").exists()
    report, _ = train(out, target, *args)  # the same command again
    assert report["steps"] == 4 and report["stopped"] == "done"


# c) refusals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--arch", "sparrow", "--target", "{text}"], "--arch sparrow needs a Video-LLM --target"),
    (["--arch", "sparrow"], "--arch sparrow needs a Video-LLM --target"),
    (["--arch", "sparrow", "--target", "qwen2.5-coder-1.5b"], "is a text-only preset"),
    (["--arch", "sparrow", "--target", "{qwen}", "--tokens", "100"], "--tokens applies to the text corpus"),
    (["--arch", "sparrow", "--target", "{qwen}", "--data", "."], "--data applies to the text corpus"),
    (["--arch", "sparrow", "--target", "{qwen}", "--top-k", "4"], "--top-k applies to the text corpus"),
    (["--arch", "sparrow", "--target", "{qwen}", "--anchor-offset", "9"], "--anchor-offset applies to --arch longspec"),
    (["--arch", "sparrow", "--target", "{qwen}", "--videos", "missing.mp4"], "--videos 'missing.mp4': no such file"),
    (["--arch", "sparrow", "--target", "{qwen}", "--frames", "0"], "--frames must be an integer >= 1"),
    (["--videos", "{a}"], "--videos applies to --arch sparrow only"),
    (["--arch", "longspec", "--frames", "4"], "--frames applies to --arch sparrow only"),
    (["--arch", "eagle1", "--text-window", "8"], "--text-window applies to --arch sparrow only"),
])
def test_cli_sparrow_refusals_come_before_loading(args, message, targets, media, offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [a.format(text=targets["text"], qwen=targets["qwen2.5-vl"], a=media["a"]) for a in args]
    result = CliRunner().invoke(app, ["train", "head", "--out", "x", *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "x").exists()


def test_cli_text_only_target_error_names_target_and_what_was_expected(targets, offline):
    result = CliRunner().invoke(app, ["train", "head", "--out", "x", "--arch", "sparrow", "--target",
                                      str(targets["text"])])
    assert result.exit_code == 2
    line = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "--target" in line[0] and "--arch sparrow" in line[0], result.output
    assert "Qwen2.5-VL or LLaVA-OneVision" in line[0] and "text-only" in line[0]


def test_no_videos_and_no_opencv_samples_says_what_to_do(targets, offline, monkeypatch, tmp_path):
    import sparrow.training.video_data as video_data

    monkeypatch.setattr(video_data, "OPENCV_SAMPLES", tmp_path / "nothing-here")
    result = CliRunner().invoke(app, ["train", "head", "--out", str(tmp_path / "x"), "--arch", "sparrow",
                                      "--target", str(targets["qwen2.5-vl"])])
    assert result.exit_code == 2 and "pass --videos" in result.output and "opencv-doc" in result.output, \
        result.output
