"""Training data of a Sparrow head (`sparrow.heads.sparrow_head`) for a Video-LLM: the target's own answers.

Each training video is read once (`sparrow.vision.video.read_video`: `frames` frames sampled uniformly, their real
timing kept) and paired with each of a small fixed set of generic questions (QUESTIONS: describe, what happens,
list the objects, ...). The answer of a (video, question) pair is the target's own greedy continuation of the
prompt its processor builds (chat template, visual placeholders expanded), as `sparrow.training.data.self_distilled`
does for text: the head learns the target's distribution on the target's own outputs. Answers are the expensive
part; they are kept in OUT/video_corpus.json after each one (with the spec they were made for), so a run stopped
by its time budget, or resumed, does not answer again.

Held out: a deterministic share of the pairs (`held_out_percent` of them, at least one; chosen by a permutation
seeded with `seed`), never used for training; held-out evaluation runs on them.

Default videos: Debian's opencv-doc sample videos (`apt-get install opencv-doc`: vtest.avi, tree.avi, Megamind.avi
under /usr/share/doc/opencv-doc/examples/data) when no --videos is given.

Features (`video_features`: the target's hidden states of the head's layers, its bridge layer and logits) are
computed in memory from the stored answers (one forward per pair) and kept on the CPU in the target's dtype (a
step moves its sequences to the head's device); they are not cached on disk: full logits of a 150k vocabulary
over a video's ~2k positions would be ~0.6 GB per pair.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sparrow.errors import UserError
from sparrow.heads.sparrow_head import video_features
from sparrow.pipeline import Pipeline
from sparrow.vision.prompt import visual_token_ids
from sparrow.vision.video import IMAGE_SUFFIXES, read_video

QUESTIONS = (
    "Describe this video in detail.",
    "What happens in this video?",
    "List the objects you can see in the video.",
    "What moves in the video, and how?",
    "Where does this video take place?",
    "Summarise the video in one sentence.",
)
VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov", ".webm", ".m4v", ".mpg", ".mpeg", ".ogv", ".wmv", ".flv")
OPENCV_SAMPLES = Path("/usr/share/doc/opencv-doc/examples/data")
"""Where Debian's opencv-doc package puts its sample videos (`dpkg -L opencv-doc | grep avi`)."""
SAMPLE_NAMES = ("vtest.avi", "tree.avi", "Megamind.avi")
CORPUS_FILE = "video_corpus.json"


def default_videos() -> list[Path]:
    """opencv-doc's sample videos that are installed, or a UserError saying what to do."""
    found = [OPENCV_SAMPLES / name for name in SAMPLE_NAMES if (OPENCV_SAMPLES / name).is_file()]
    if not found:
        raise UserError(f"--arch sparrow trains on videos: pass --videos PATH (a video file, a directory of videos or "
                        f"of frame images; repeatable), or install Debian's sample videos (apt-get install "
                        f"opencv-doc: {', '.join(SAMPLE_NAMES)} under {OPENCV_SAMPLES}), the default")
    return found


def video_sources(paths: Sequence[str | Path]) -> list[str]:
    """--videos values -> the videos they name, each a file or a directory of frame images (what
    `read_video` takes): a directory holding video files stands for each of them (sorted by name), a directory
    without any for itself (its frames)."""
    found: list[str] = []
    for given in paths:
        path = Path(given).expanduser()
        if path.is_file():
            found.append(str(path.resolve()))
        elif path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES)
            if files:
                found.extend(str(p.resolve()) for p in files)
            elif any(p.suffix.lower() in IMAGE_SUFFIXES for p in path.iterdir()):
                found.append(str(path.resolve()))
            else:
                raise UserError(f"--videos {str(given)!r}: the directory holds no video files "
                                f"({', '.join(VIDEO_SUFFIXES)}) and no frame images")
        else:
            raise UserError(f"--videos {str(given)!r}: no such file or directory")
    unique = list(dict.fromkeys(found))
    if not unique:
        raise UserError("--videos: no videos given")
    return unique


@dataclass(frozen=True)
class VideoSpec:
    """What a video corpus is made of; equal specs (for the same target) make equal corpora."""

    videos: tuple[str, ...]  # resolved paths: video files or directories of frames
    frames: int = 8  # sampled uniformly from each video
    questions: tuple[str, ...] = QUESTIONS
    answer_tokens: int = 128  # new tokens per answer (the target's greedy continuation)
    held_out_percent: int = 5  # of the (video, question) pairs; at least one
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.videos or not self.questions:
            raise UserError("--videos: a Sparrow head needs at least one video and one question")
        for name, value in (("--frames", self.frames), ("--distill-tokens", self.answer_tokens)):
            if isinstance(value, bool) or value < 1:
                raise UserError(f"{name} must be an integer >= 1, got {value}")
        if not 0 < self.held_out_percent < 100:
            raise UserError(f"--held-out-percent must be in 1..99, got {self.held_out_percent}")
        if len(self.videos) * len(self.questions) < 2:
            raise UserError("--videos: one (video, question) pair cannot be split into training and held-out data")

    def pairs(self) -> list[tuple[str, str, bool]]:
        """Every (video, question, held out) in order, video-major. The held-out pairs: the first
        max(1, round(n * held_out_percent / 100)) of a permutation seeded with `seed` (at most n - 1)."""
        pairs = [(v, q) for v in self.videos for q in self.questions]
        count = min(len(pairs) - 1, max(1, round(len(pairs) * self.held_out_percent / 100)))
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(self.seed)).tolist()
        held = set(order[:count])
        return [(v, q, i in held) for i, (v, q) in enumerate(pairs)]

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))

    @staticmethod
    def from_json(record: dict[str, Any]) -> VideoSpec:
        known = {f.name for f in fields(VideoSpec)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in known}
        return VideoSpec(**values)


@dataclass(frozen=True)
class Sample:
    """One (video, question) pair and the target's answer to it."""

    video: str
    question: str
    held_out: bool
    answer: tuple[int, ...]  # the target's new token ids


def load_answers(spec: VideoSpec, directory: Path, target: str) -> dict[tuple[str, str], list[int]]:
    """The answers kept in directory/video_corpus.json if they were made for `spec` and `target`, else none."""
    path = directory / CORPUS_FILE
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    if record.get("spec") != spec.to_json() or record.get("target") != target:
        return {}
    return {(a["video"], a["question"]): list(a["answer"]) for a in record.get("answers", [])}


def save_answers(spec: VideoSpec, directory: Path, target: str, answers: dict[tuple[str, str], list[int]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    held = {(v, q): h for v, q, h in spec.pairs()}
    record = {"spec": spec.to_json(), "target": target,
              "answers": [{"video": v, "question": q, "held_out": held[(v, q)], "answer": a}
                          for (v, q), a in answers.items()]}
    partial = directory / (CORPUS_FILE + ".partial")
    partial.write_text(json.dumps(record) + "\n")
    partial.replace(directory / CORPUS_FILE)


def stored_spec(directory: Path) -> VideoSpec | None:
    """The spec of the video corpus in `directory` (None if it has none)."""
    path = directory / CORPUS_FILE
    return VideoSpec.from_json(json.loads(path.read_text())["spec"]) if path.is_file() else None


def read_videos(spec: VideoSpec) -> dict[str, Any]:
    """Each video of `spec`, read once (`spec.frames` frames sampled uniformly)."""
    return {v: read_video(v, spec.frames) for v in spec.videos}


def self_distilled_answers(spec: VideoSpec, loaded: Any, directory: Path, target: str,
                           progress: Callable[[int, int], None] | None = None,
                           out_of_time: Callable[[], bool] = lambda: False,
                           videos: dict[str, Any] | None = None) -> list[Sample] | None:
    """The target's greedy answer to every (video, question) pair of `spec` (kept answers reused, new ones saved
    after each). None when `out_of_time()` said stop before all were answered (those made so far are kept)."""
    if not loaded.is_vlm:
        raise UserError(f"--target {target!r} is a text-only model; --arch sparrow needs a Video-LLM target "
                        "(Qwen2.5-VL or LLaVA-OneVision, a directory with its processor)")
    answers = load_answers(spec, directory, target)
    pairs = spec.pairs()
    videos = videos if videos is not None else read_videos(spec)
    plain = Pipeline(loaded, None)
    done = sum((v, q) in answers for v, q, _ in pairs)
    if progress is not None:
        progress(done, len(pairs))
    for video, question, _ in pairs:
        if (video, question) in answers:
            continue
        if out_of_time():
            return None
        result = plain.generate_plain(question, max_new_tokens=spec.answer_tokens, video=videos[video])
        answers[(video, question)] = list(result.token_ids)
        save_answers(spec, directory, target, answers)
        done += 1
        if progress is not None:
            progress(done, len(pairs))
    return [Sample(v, q, h, tuple(answers[(v, q)])) for v, q, h in pairs]


def _on(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if not isinstance(value, Tensor):
        return value
    return value.to(device=device, dtype=dtype) if value.is_floating_point() else value.to(device)


def sample_features(loaded: Any, head: Any, samples: Sequence[Sample], spec: VideoSpec,
                    progress: Callable[[int, int], None] | None = None,
                    out_of_time: Callable[[], bool] = lambda: False,
                    videos: dict[str, Any] | None = None) -> list[Any] | None:
    """The Sparrow head's training features (`video_features`) of each sample, on the CPU in the target's dtype.
    None when `out_of_time()` said stop first."""
    model = loaded.model
    parameter = next(model.parameters())
    visual = visual_token_ids(model.config)
    videos = videos if videos is not None else read_videos(spec)
    plain = Pipeline(loaded, None)
    out = []
    for i, sample in enumerate(samples):
        if out_of_time():
            return None
        prompt = plain.encode(sample.question, video=videos[sample.video])
        inputs = {k: _on(v, parameter.device, parameter.dtype if k.startswith("pixel_values") else v.dtype)
                  if isinstance(v, Tensor) else v for k, v in prompt.model_inputs.items()}
        f = video_features(model, head, prompt.input_ids, inputs, torch.tensor(sample.answer, dtype=torch.long),
                           visual)
        out.append(replace(f, tokens=f.tokens.cpu(), visual=f.visual.cpu(), hidden=f.hidden.cpu(),
                           bridged=f.bridged.cpu(), logits=f.logits.cpu()))
        if progress is not None:
            progress(i + 1, len(samples))
    return out


def text_tokens(features: Sequence[Any]) -> list[Tensor]:
    """The text (non-visual) token ids of each feature sequence (for the draft vocabulary's counts)."""
    return [f.tokens[~f.visual] for f in features]


__all__ = ["CORPUS_FILE", "OPENCV_SAMPLES", "QUESTIONS", "SAMPLE_NAMES", "Sample", "VideoSpec", "default_videos",
           "load_answers", "read_videos", "sample_features", "self_distilled_answers", "stored_spec",
           "text_tokens", "video_sources"]
