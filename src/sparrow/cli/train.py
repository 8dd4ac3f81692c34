"""`sparrow train head`: train an EAGLE head for a target on this machine (the pieces: sparrow.heads.{data,
features,train,trainer,plot}).

Stages, each resumable: the corpus (installed source files and docs, plus the target's own answers;
OUT/corpus.*), the feature cache (the target's hidden states and top-k labels; OUT/features/), training
(checkpoints in OUT in the head's layout, trainer_state.pt, train_log.jsonl), then a held-out evaluation
(OUT/eval.json) and a plot (OUT/training.png). `--time-budget` stops any stage cleanly; `--resume` continues.
Heads: eagle3 / eagle1 (with Dovetail's `--fusion gated` and `--layers N`) train on the feature cache; a longspec
head reads the target's KV at anchor-offset positions drawn each step, so it runs the target while training
(no feature cache).

`--arch sparrow` (Video-LLM targets: a Qwen2.5-VL or LLaVA-OneVision directory) trains a Sparrow head
(`sparrow.heads.sparrow_head`: no visual KV, a window of text rows, the target's hidden states reused, visual rows
bridged to an intermediate layer while training, multi-token prediction) on videos instead of the text corpus
(`sparrow.training.video_data`): each of `--videos` (default: Debian's opencv-doc sample videos), `--frames` frames
sampled uniformly, asked a fixed set of generic questions; the answers are the target's own greedy continuations
(OUT/video_corpus.json, kept as they come), a share of the (video, question) pairs is held out. Features are
computed in memory (no feature cache: full logits over a video's positions); training, checkpoints, the time budget,
`--resume` (answers reused, features recomputed), the held-out evaluation and the plot are the text path's.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from sparrow.cli._common import DTYPE_HELP, DType, check_float, check_int, cli_errors, err
from sparrow.errors import UserError

train_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                        help="Train draft heads for a target on this machine.", no_args_is_help=True)

DEFAULT_DRAFT_VOCAB = 32000
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_TOP_K = 32
DEFAULT_ANCHOR_OFFSET = 30_000  # LongSpec's recipe: random offsets up to ~30k
DEFAULT_TOKENS, DEFAULT_SEQ_LEN, DEFAULT_DISTILL = 200_000, 512, 32  # the text corpus' --tokens, --seq-len, --distill
DEFAULT_FRAMES = 8  # = sparrow.vision.prompt.DEFAULT_FRAMES (`sparrow generate --frames`)
DEFAULT_TEXT_WINDOW = 32  # = SparrowSpec's
SPARROW_EPOCHS = 10  # default steps of --arch sparrow: few (video, question) pairs, long sequences
TEXT_CORPUS_OPTIONS = ("data", "tokens", "held_out_tokens", "seq_len", "distill", "distill_batch", "top_k",
                       "features")
VIDEO_OPTIONS = ("videos", "frames", "text_window")
RUN = "run.json"  # what a resumed run needs that its checkpoint does not hold: target, dtype, top-k, cache, recipe


@train_app.command("head")
@cli_errors
def head(
    out: Annotated[Optional[Path], typer.Option(help="Run directory: the head (eagle3: SpecForge's EAGLE-3 layout; every arch loads with --drafter eagle --head OUT), checkpoints, features, log, plot. Default for a preset target: <sparrow cache>/heads/<preset>, where --drafter eagle finds it without --head.")] = None,
    target: Annotated[Optional[str], typer.Option(help=f"Target model: preset, local dir or hub id (default {DEFAULT_TARGET}; --arch sparrow: a Qwen2.5-VL or LLaVA-OneVision directory or hub id; with --resume, the run's).")] = None,
    arch: Annotated[Optional[str], typer.Option(help="eagle3 (three fused target layers, own reduced LM head), eagle1 (last layer, the target's LM head), longspec (sliding-window self-attention + cross-attention over the target's KV cache; trains at anchor-offset positions) or sparrow (Video-LLM targets, Qwen2.5-VL / LLaVA-OneVision: an EAGLE-3 head with no visual KV and a text window, trained on the target's answers about --videos). Default eagle3; with --resume, the run's.")] = None,
    fusion: Annotated[Optional[str], typer.Option(help="How eagle3/eagle1/sparrow heads mix feature and token embedding: concat (EAGLE; vLLM/SGLang read it) or gated (Dovetail's gating fusion; sparrow-only tensors gate.*). Default concat.")] = None,
    layers: Annotated[Optional[int], typer.Option(help="Decoder layers of an eagle3/eagle1/sparrow head (Dovetail: deeper heads; > 1 is sparrow-only: layers.1.* tensors). Default 1.")] = None,
    intermediate_size: Annotated[Optional[int], typer.Option(help="MLP width of an eagle3/eagle1/sparrow head's decoder layer (default: the target's, as SpecForge's heads; smaller heads draft cheaper on a CPU).")] = None,
    anchor_offset: Annotated[Optional[int], typer.Option(help=f"longspec: shift training positions (after 0-4 sink tokens) by a random offset up to N, so short text trains long-context positions (LongSpec's anchor-offset indices; default min({DEFAULT_ANCHOR_OFFSET}, the target's max positions - the longest training sequence)).")] = None,
    draft_vocab: Annotated[Optional[int], typer.Option(help=f"eagle3, sparrow: the N most frequent target tokens of the training data (FR-Spec; default {DEFAULT_DRAFT_VOCAB}, at most the vocabulary).")] = None,
    videos: Annotated[Optional[list[Path]], typer.Option(help="sparrow: a video file (any the video reader takes, e.g. .mp4/.avi), a directory of video files, or a directory of frame images (repeatable; default: opencv-doc's sample videos under /usr/share/doc/opencv-doc/examples/data).")] = None,
    frames: Annotated[Optional[int], typer.Option(help=f"sparrow: frames sampled uniformly from each video (default {DEFAULT_FRAMES}).")] = None,
    text_window: Annotated[Optional[int], typer.Option(help=f"sparrow: text rows each head row attends to (Sparrow's text-anchored window; default {DEFAULT_TEXT_WINDOW}).")] = None,
    data: Annotated[Optional[list[Path]], typer.Option(help="Directory or file of .py/.md/.rst text (repeatable; default: the standard library and installed packages).")] = None,
    tokens: Annotated[Optional[int], typer.Option(help=f"Training tokens taken from files (self-distilled answers come on top; default {DEFAULT_TOKENS}).")] = None,
    held_out_tokens: Annotated[Optional[int], typer.Option(help="Held-out tokens from other files (default: tokens / 20, at least 2 sequences).")] = None,
    held_out_percent: Annotated[int, typer.Option(help="Share of files (by a hash of their path) held out for evaluation; sparrow: of the (video, question) pairs (at least one).")] = 5,
    seq_len: Annotated[Optional[int], typer.Option(help=f"Tokens per training sequence (default {DEFAULT_SEQ_LEN}).")] = None,
    distill: Annotated[Optional[int], typer.Option(help=f"Self-distilled sequences: the target's greedy answers to prompts built from training files (held out: a tenth; default {DEFAULT_DISTILL}).")] = None,
    distill_tokens: Annotated[int, typer.Option(help="New tokens per self-distilled answer (sparrow: per answer about a video).")] = 128,
    distill_batch: Annotated[Optional[int], typer.Option(help="Self-distilled answers generated together (transformers' batched greedy generate over left-padded prompts); default 32 on a GPU, 16 on a CPU (qwen2.5-coder-1.5b, bf16, AMD EPYC, 2 threads: 40 tokens/s at 16 against 4 one at a time); 1 = sparrow's plain decoding, one answer at a time.")] = None,
    steps: Annotated[Optional[int], typer.Option(help=f"Optimiser steps in total (default: 2 epochs of the training sequences; sparrow: {SPARROW_EPOCHS} epochs of its training pairs).")] = None,
    time_budget: Annotated[Optional[float], typer.Option(help="Seconds for the whole command; stops cleanly (checkpoint, cache) when spent; --resume continues.")] = None,
    batch_size: Annotated[int, typer.Option(help="Sequences per optimiser step.")] = 4,
    ttt_steps: Annotated[int, typer.Option(help="Training-time-test depth: draft steps trained on the head's own features (EAGLE-3).")] = 3,
    lr: Annotated[float, typer.Option(help="AdamW learning rate (after a linear warmup).")] = 5e-4,
    top_k: Annotated[Optional[int], typer.Option(help="Soft labels kept per position: the target's top-k log-probs (default 32; with --resume, the run's).")] = None,
    checkpoint_every: Annotated[int, typer.Option(help="Save a checkpoint every N steps.")] = 100,
    eval_every: Annotated[int, typer.Option(help="Held-out evaluation every N steps.")] = 50,
    seed: Annotated[int, typer.Option(help="Seed of the file sample, the head's initial weights and the data order.")] = 0,
    features: Annotated[Optional[Path], typer.Option(help="Feature cache directory (default OUT/features, or the resumed run's; share one between runs of the same target and layers).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in OUT from its last checkpoint (its corpus and recipe; --steps may extend it).")] = False,
    dtype: Annotated[DType, typer.Option(help=DTYPE_HELP + " The head trains in float32. With --resume, auto = the run's.")] = DType.auto,
    device: Annotated[Optional[str], typer.Option(help="Default: cuda if available, else cpu.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Rich progress bars on stderr.")] = True,
) -> None:
    """Train a draft head on the target's own outputs: EAGLE-3 (FR-Spec draft vocabulary, training-time test),
    EAGLE-1, Dovetail's gated / deeper variants, a LongSpec head, or (Video-LLM targets) a Sparrow head trained on
    the target's answers about --videos; checkpoints, resume, held-out evaluation."""
    from sparrow.training.data import CorpusSpec, default_roots
    from sparrow.training.trainer import TrainSettings, read_state

    started = time.monotonic()
    deadline = None if time_budget is None else started + time_budget
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True  # the head trains in float32: TF32 matmuls on a GPU (no-op on a CPU)
    check_float("--time-budget", time_budget, "a finite number of seconds > 0", lambda s: s > 0)
    check_float("--lr", lr, "a finite number > 0", lambda v: v > 0)
    for flag, value, low in (("--steps", steps, 1), ("--top-k", top_k, 1), ("--draft-vocab", draft_vocab, 1),
                             ("--layers", layers, 1), ("--intermediate-size", intermediate_size, 1),
                             ("--distill-batch", distill_batch, 1), ("--anchor-offset", anchor_offset, 0),
                             ("--frames", frames, 1), ("--text-window", text_window, 1)):
        check_int(flag, value, low)
    if out is None:
        from sparrow.heads.layout import default_head_dir

        out = default_head_dir(target or DEFAULT_TARGET)
        if out is None:
            raise UserError(f"--out is needed for --target {target!r}: only presets have a default head directory")
    state = read_state(out, lambda message: err.print(f"sparrow: {message}", markup=False, highlight=False,
                                                      soft_wrap=True))
    begun = _started_run(out) if resume and state is None else None  # killed before its first checkpoint
    stored_arch = _arch_of(state) if resume and state is not None else begun["arch"] if begun else None
    _check_variant(arch or stored_arch or "eagle3", fusion, layers, draft_vocab, anchor_offset, intermediate_size)
    _check_data_options(arch or stored_arch or "eagle3", {
        name for name, value in (("data", data), ("tokens", tokens), ("held_out_tokens", held_out_tokens),
                                 ("seq_len", seq_len), ("distill", distill), ("distill_batch", distill_batch),
                                 ("top_k", top_k), ("features", features),
                                 ("videos", videos), ("frames", frames), ("text_window", text_window))
        if value is not None})
    if not resume and state is not None:
        raise UserError(f"--out {str(out)!r} already holds a training run: pass --resume to continue it, or choose "
                        "another directory")
    if (arch or stored_arch) == "sparrow":
        _sparrow(out, target, state, resume, steps, time_budget, started, dtype, device, progress, draft_vocab,
                 HeadVariant(fusion or "concat", layers or 1, intermediate_size=intermediate_size), videos, frames,
                 text_window, held_out_percent, distill_tokens, lr, batch_size, ttt_steps, checkpoint_every,
                 eval_every, seed, arch, fusion, layers)
        return
    variant = HeadVariant(fusion or "concat", layers or 1, anchor_offset is not None, intermediate_size)
    steps_given = steps is not None
    if resume and begun is not None:  # no checkpoint yet: step 0 of the run's recipe, its corpus and features
        recipe = begun["recipe"]
        variant = HeadVariant(**recipe["variant"])
        _check_resumed_variant(_started_variant(begun), arch, fusion, layers, anchor_offset, intermediate_size,
                               draft_vocab)
        spec, settings = _recipe_run(recipe, steps)
        draft_vocab, steps_given = recipe["draft_vocab"], steps_given or recipe["steps_given"]
    elif resume:
        _check_resumed_variant(_checkpoint_variant(state), arch, fusion, layers, anchor_offset, intermediate_size)
        spec, settings = _stored_run(out, state, steps)
    if resume:
        stored = json.loads((out / RUN).read_text()) if (out / RUN).is_file() else {}
        target = target or stored.get("target")
        top_k = top_k or stored.get("top_k")
        features = features or (Path(stored["features"]) if stored.get("features") else None)
        if dtype == DType.auto and stored.get("dtype"):
            dtype = DType(stored["dtype"])
    else:
        tokens = DEFAULT_TOKENS if tokens is None else tokens
        seq_len = DEFAULT_SEQ_LEN if seq_len is None else seq_len
        distill = DEFAULT_DISTILL if distill is None else distill
        spec = CorpusSpec(roots=tuple(str(p) for p in data) if data else tuple(map(str, default_roots())),
                          tokens=tokens, held_out_tokens=held_out_tokens if held_out_tokens is not None
                          else max(tokens // 20, 2 * seq_len), sequence_length=seq_len, distill=distill,
                          held_out_percent=held_out_percent,
                          distill_tokens=distill_tokens, seed=seed)
        settings = TrainSettings(steps=steps or 1, lr=lr, batch_size=batch_size, ttt_steps=ttt_steps,
                                 checkpoint_every=checkpoint_every, eval_every=eval_every, seed=seed,
                                 anchor_offset=anchor_offset or 0)
    run = _Run(out, target or DEFAULT_TARGET, spec, settings, state, stored_arch or arch or "eagle3", draft_vocab,
               top_k or DEFAULT_TOP_K, features or out / "features", deadline, progress, steps_given=steps_given,
               variant=variant, distill_batch=distill_batch)
    run.go(dtype.value, device)


@train_app.command("export-int8")
@cli_errors
def export_int8(
    head: Annotated[Path, typer.Option(help="A dense head directory (config.json + model.safetensors: saved by `sparrow train head` or exported by SpecForge).")],
    out: Annotated[Path, typer.Option(help="New directory for the int8 export: manifest.json + int8 safetensors shards of at most 15 MB, 60 MB in all; loads with --drafter eagle --head OUT.")],
) -> None:
    """Write a head's per-channel int8 export (symmetric per-row scales; norms and maps kept as they are), which
    --drafter eagle --head loads transparently, dequantized to the target's dtype."""
    from sparrow.heads.layout import export_int8 as export

    written = export(head, out)
    typer.echo(json.dumps({"out": str(out), "head_id": written.head_id, "shards": len(written.shard_bytes),
                           "bytes": written.total_bytes}))


@dataclass(frozen=True)
class HeadVariant:
    """The shape options of a new head beyond its arch (a resumed head takes its checkpoint's)."""

    fusion: str = "concat"
    layers: int = 1
    anchor_offset_given: bool = False  # --anchor-offset given (else LongSpec's default, fitted to the target)
    intermediate_size: int | None = None  # the decoder layer's MLP width (None: the target's)

    def shape(self) -> dict[str, Any]:
        """new_head's keyword arguments for this variant."""
        size = {} if self.intermediate_size is None else {"intermediate_size": self.intermediate_size}
        return {"fusion": self.fusion, "layers": self.layers, **size}


def _check_variant(arch: str, fusion: str | None, layers: int | None, draft_vocab: int | None,
                   anchor_offset: int | None, intermediate_size: int | None = None) -> None:
    """Refuse a combination of head options that cannot be built, before any model loads."""
    from sparrow.heads.config import FUSIONS, HEAD_ARCHS

    if arch not in HEAD_ARCHS:
        raise UserError(f"--arch must be one of {', '.join(HEAD_ARCHS)}, got {arch!r}")
    if fusion is not None and fusion not in FUSIONS:
        raise UserError(f"--fusion must be one of {', '.join(FUSIONS)}, got {fusion!r}")
    if arch == "longspec":
        for flag, value, default in (("--fusion", fusion, "concat"), ("--layers", layers, 1),
                                     ("--intermediate-size", intermediate_size, None)):
            if value is not None and value != default:
                raise UserError(f"{flag} applies to --arch eagle3 or eagle1: a LongSpec head is one layer over the "
                                "token embedding (no target feature to fuse) and cross-attention over the target's KV")
        if draft_vocab is not None:
            raise UserError("--draft-vocab applies to --arch eagle3 only (a LongSpec head drafts with the target's "
                            "LM head)")
        return
    if anchor_offset is not None:
        article = "a" if arch == "sparrow" else "an"
        raise UserError(f"--anchor-offset applies to --arch longspec only ({article} {arch} head reads the target's "
                        "hidden states at their real positions)")
    if arch == "eagle1" and draft_vocab is not None:
        raise UserError("--draft-vocab applies to --arch eagle3 only (an EAGLE-1 head drafts with the target's LM head)")


def _checkpoint_variant(state: dict[str, Any]) -> dict[str, Any]:
    """The shape flags of a checkpointed head."""
    config, settings = state["head_config"], state["settings"]
    return {"--arch": _arch_of(state), "--fusion": config.get("fusion", "concat"),
            "--layers": config.get("num_layers", 1), "--anchor-offset": settings.get("anchor_offset", 0),
            "--intermediate-size": config.get("intermediate_size")}


def _started_variant(started: dict[str, Any]) -> dict[str, Any]:
    """The shape flags of a run started without a checkpoint yet (its run.json)."""
    recipe = started["recipe"]
    variant, settings = recipe["variant"], recipe["settings"]
    return {"--arch": started["arch"], "--fusion": variant["fusion"], "--layers": variant["layers"],
            "--anchor-offset": settings["anchor_offset"] if variant["anchor_offset_given"] else None,
            "--intermediate-size": variant["intermediate_size"], "--draft-vocab": recipe["draft_vocab"]}


def _check_resumed_variant(stored: dict[str, Any], arch: str | None, fusion: str | None, layers: int | None,
                           anchor_offset: int | None, intermediate_size: int | None = None,
                           draft_vocab: int | None = None) -> None:
    """With --resume the head is the run's (`stored`: its shape flags): refuse shape options that say otherwise."""
    given = {"--arch": arch, "--fusion": fusion, "--layers": layers, "--anchor-offset": anchor_offset,
             "--intermediate-size": intermediate_size, "--draft-vocab": draft_vocab}
    for flag, value in given.items():
        if value is not None and flag in stored and value != stored[flag]:
            raise UserError(f"--resume continues the run's head ({flag} {stored[flag]}); {flag} {value} would need a "
                            "new run in another --out directory")


def _arch_of(state: dict[str, Any]) -> str:
    """The --arch of a checkpointed head (a Sparrow head is an EAGLE-3 head with a SparrowSpec)."""
    return "sparrow" if state.get("sparrow") is not None else state["head_config"]["arch"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_data_options(arch: str, given: set[str]) -> None:
    """The text corpus' options with --arch sparrow, or the video options with another arch: refused, not ignored."""
    if arch == "sparrow":
        for name in TEXT_CORPUS_OPTIONS:
            if name in given:
                raise UserError(f"{_flag(name)} applies to the text corpus of --arch eagle3, eagle1 or longspec; "
                                "--arch sparrow trains on the target's answers about --videos (see --frames, "
                                "--distill-tokens, --held-out-percent)")
        return
    for name in VIDEO_OPTIONS:
        if name in given:
            raise UserError(f"{_flag(name)} applies to --arch sparrow only (a Video-LLM target's draft head)")


def _text_only_target(target: str) -> str | None:
    """Why `target` is known to be text-only before loading it (a preset, a GGUF file, a model directory whose
    config has no vision_config), else None (a Video-LLM directory, or a hub id: checked once loaded)."""
    from sparrow.models.presets import PRESETS

    if target.strip().lower() in PRESETS:
        return "a text-only preset"
    path = Path(target).expanduser()
    if path.suffix.lower() == ".gguf":
        return "a GGUF file (text-only)"
    config = path / "config.json"
    if path.is_dir() and config.is_file():
        try:
            record = json.loads(config.read_text())
        except (OSError, ValueError):
            return None
        if record.get("vision_config") is None:
            kind = ",".join(record.get("architectures") or []) or record.get("model_type") or "a model"
            return f"a text-only model ({kind}, no vision_config)"
    return None


def _check_video_target(target: str | None) -> None:
    if target is None:
        raise _video_target_error(DEFAULT_TARGET, "the default, a text-only preset (give --target)")
    why = _text_only_target(target)
    if why is not None:
        raise _video_target_error(target, why)


def _video_target_error(target: str, why: str) -> UserError:
    return UserError(f"--arch sparrow needs a Video-LLM --target: a directory (or hub id) of a Qwen2.5-VL or "
                     f"LLaVA-OneVision model with its processor; --target {target!r} is {why}")


def _sparrow(out: Path, target: str | None, state: dict[str, Any] | None, resume: bool, steps: int | None,
             time_budget: float | None, started: float, dtype: DType, device: str | None, progress: bool,
             draft_vocab: int | None, variant: HeadVariant, videos: list[Path] | None, frames: int | None,
             text_window: int | None, held_out_percent: int, distill_tokens: int, lr: float, batch_size: int,
             ttt_steps: int, checkpoint_every: int, eval_every: int, seed: int, arch: str | None,
             fusion: str | None, layers: int | None) -> None:
    """`sparrow train head --arch sparrow`: checks before any model loads, then a _SparrowRun."""
    from dataclasses import replace

    from sparrow.training.trainer import TrainSettings
    from sparrow.training.video_data import VideoSpec, default_videos, stored_spec, video_sources

    if resume:
        assert state is not None
        _check_resumed_variant(_checkpoint_variant(state), arch, fusion, layers, None)
        for name, value in (("videos", videos), ("frames", frames), ("text_window", text_window),
                            ("draft_vocab", draft_vocab)):
            if value is not None:
                raise UserError(f"--resume continues the run's head and videos; {_flag(name)} would need a new run "
                                "in another --out directory")
        spec = stored_spec(out)
        if spec is None:
            raise UserError(f"--resume: {str(out)!r} has a Sparrow checkpoint but no video_corpus.json; it was not "
                            "made by `sparrow train head --arch sparrow`")
        stored = json.loads((out / RUN).read_text()) if (out / RUN).is_file() else {}
        target = target or stored.get("target")
        if dtype == DType.auto and stored.get("dtype"):
            dtype = DType(stored["dtype"])
        settings = TrainSettings(**state["settings"])
        settings = replace(settings, steps=steps) if steps is not None else settings
    else:
        _check_video_target(target)
        spec = VideoSpec(tuple(video_sources(videos)) if videos else tuple(str(p) for p in default_videos()),
                         frames=frames or DEFAULT_FRAMES, answer_tokens=distill_tokens,
                         held_out_percent=held_out_percent, seed=seed)
        settings = TrainSettings(steps=steps or 1, lr=lr, batch_size=batch_size, ttt_steps=ttt_steps,
                                 checkpoint_every=checkpoint_every, eval_every=eval_every, seed=seed)
    _check_video_target(target)
    deadline = None if time_budget is None else started + time_budget
    run = _SparrowRun(out, target, spec, settings, state, "sparrow", draft_vocab, DEFAULT_TOP_K, out / "features",
                      deadline, progress, steps_given=steps is not None, variant=variant)
    run.text_window = text_window or DEFAULT_TEXT_WINDOW
    run.go(dtype.value, device)


class _Run:
    """One invocation of `sparrow train head`: the stages in order, sharing the loaded target and a console."""

    def __init__(self, out: Path, target: str, spec: Any, settings: Any, state: dict[str, Any] | None, arch: str,
                 draft_vocab: int | None, top_k: int, features: Path, deadline: float | None, progress: bool,
                 steps_given: bool, variant: HeadVariant = HeadVariant(), distill_batch: int | None = None) -> None:
        self.out, self.target_name, self.spec, self.settings, self.state = out, target, spec, settings, state
        self.arch, self.draft_vocab, self.top_k, self.features_dir = arch, draft_vocab, top_k, features
        self.deadline, self.progress, self.steps_given, self.variant = deadline, progress, steps_given, variant
        self.distill_batch = distill_batch  # None: by device (`corpus`)
        self.model: Any = None  # the loaded target's transformers model (set by `go`)
        self.timings: dict[str, float] = {}

    def say(self, message: str) -> None:
        err.print(message, markup=False, highlight=False, soft_wrap=True)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def go(self, dtype: str, device: str | None) -> None:
        from dataclasses import replace

        from sparrow.models import load_model

        self.out.mkdir(parents=True, exist_ok=True)
        loaded = load_model(self.target_name, dtype=dtype, device=device, progress=self.progress)
        self.model = loaded.model
        if self.state is None:
            run_dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
            # what `--resume` needs before the first checkpoint
            recipe = {"spec": asdict(self.spec), "settings": asdict(self.settings), "steps_given": self.steps_given,
                      "variant": asdict(self.variant), "draft_vocab": self.draft_vocab}
            (self.out / RUN).write_text(json.dumps({"target": self.target_name, "dtype": run_dtype,
                                                    "top_k": self.top_k, "features": None if self.features_dir == self.out / "features"
                                                    else str(self.features_dir.resolve()), "arch": self.arch,
                                                    "recipe": recipe}) + "\n")
        corpus = self.corpus(loaded)
        if not self.steps_given and self.state is None:  # default: 2 epochs
            self.settings = replace(self.settings, steps=max(1, math.ceil(2 * len(corpus.train) / self.settings.batch_size)))
        if self.arch == "longspec" and self.state is None and not self.variant.anchor_offset_given:
            self.settings = replace(self.settings, anchor_offset=_default_anchor_offset(loaded.model, corpus))
        head = self.head(loaded, corpus)
        train, held_out = self.extract(loaded, head, corpus)
        if train is None:
            self.say(f"time budget spent during feature extraction; the cache in {self.features_dir} is kept: "
                     f"rerun the same command to continue")
            return
        outcome = self.train(head, train, held_out)
        self.finish(loaded, head, held_out, outcome, corpus)

    # --- stages -------------------------------------------------------------------------------------------

    def corpus(self, loaded: Any) -> Any:
        from sparrow.training.data import build_corpus, load_corpus, save_corpus

        corpus = load_corpus(self.spec, self.out)
        if corpus is not None:
            self.say(f"corpus: {len(corpus.train)} training / {len(corpus.held_out)} held-out sequences "
                     f"(cached in {self.out})")
            return corpus
        start = time.monotonic()
        with self.bars() as bars:
            batch = self.distill_batch or (32 if loaded.model.device.type == "cuda" else 16)
            corpus = build_corpus(self.spec, loaded, bars.callback, batch)
        save_corpus(corpus, self.spec, self.out)
        self.timings["corpus_seconds"] = time.monotonic() - start
        self.say(f"corpus: {len(corpus.train)} training sequences ({corpus.train_tokens} tokens, "
                 f"{len(corpus.files.get('train', []))} files), {len(corpus.held_out)} held-out")
        return corpus

    def head(self, loaded: Any, corpus: Any) -> Any:
        import torch

        from sparrow.heads.factory import new_head
        from sparrow.training.trainer import resumed_head

        model = loaded.model
        device = next(model.parameters()).device
        if self.state is not None:
            self.say(f"resuming from step {self.state['step']} in {self.out}")
            return resumed_head(self.out, self.state, model, device)
        ids = self.draft_vocabulary(loaded, corpus.train) if self.arch == "eagle3" else None
        generator = torch.Generator(device=device).manual_seed(self.settings.seed)
        shape = {} if self.arch == "longspec" else self.variant.shape()
        head = new_head(model, self.arch, generator, draft_vocab=ids, **shape).float()
        init_from_target(head, model)
        return head

    def draft_vocabulary(self, loaded: Any, sequences: Any) -> Any:
        """FR-Spec: the target ids of the draft vocabulary, the --draft-vocab (default DEFAULT_DRAFT_VOCAB, at most
        the target's vocabulary) most frequent tokens of `sequences` ([n] target ids each), EOS ids included."""
        from sparrow.training.heads import frequent_tokens

        vocab = loaded.model.get_output_embeddings().weight.shape[0]
        size = min(self.draft_vocab or DEFAULT_DRAFT_VOCAB, vocab)
        return frequent_tokens(sequences, size, vocab, always=sorted(i for i in loaded.eos_token_ids() if 0 <= i < vocab))

    def extract(self, loaded: Any, head: Any, corpus: Any) -> tuple[Any, Any]:
        from sparrow.training.features import CacheIdentity, FeatureCache, target_identity

        if self.arch == "longspec":  # it reads the target's KV at positions drawn each step: no feature cache
            return corpus.train, corpus.held_out
        identity = CacheIdentity(target_identity(loaded.model, self.target_name), head.config.target_layers,
                                 self.top_k)
        device = next(loaded.model.parameters()).device
        views = []
        start = time.monotonic()
        computed = 0
        with self.bars() as bars:
            for split, sequences in (("train", corpus.train), ("held_out", corpus.held_out)):
                cache = FeatureCache(self.features_dir / split, identity)
                computed += cache.extract(loaded.model, sequences,
                                          lambda d, t, s=split: bars.callback(f"features {s}", d, t),
                                          self.out_of_time)
                if not cache.complete(len(sequences)):
                    return None, None
                views.append(cache.view(len(sequences), device))
        seconds = time.monotonic() - start
        if computed:
            positions = sum(t.numel() for t in corpus.train + corpus.held_out)
            self.timings.update(feature_seconds=seconds, feature_positions_per_second=positions / max(seconds, 1e-9))
        return views[0], views[1]

    def train(self, head: Any, train: Any, held_out: Any) -> Any:
        from sparrow.training.trainer import run_training

        start_step = int(self.state["step"]) if self.state is not None else 0
        with self.bars() as bars:
            bars.update("training", start_step, self.settings.steps)
            held = "-"

            def on_step(row: dict[str, Any]) -> None:
                nonlocal held
                if "held_out_agreement" in row:
                    held = f"{row['held_out_agreement'][0]:.3f}"
                bars.update("training", row["step"], self.settings.steps, f"loss {row['loss']:.3f}  agree "
                            f"{row['agreement']:.3f}  held-out agree {held}")

            outcome = run_training(head, train, held_out, self.settings, self.out, self.state, self.deadline, on_step,
                                   model=self.model)
        self.timings.update(train_seconds=outcome.seconds,
                            steps_per_second=(outcome.step - start_step) / max(outcome.seconds, 1e-9))
        return outcome

    def finish(self, loaded: Any, head: Any, held_out: Any, outcome: Any, corpus: Any) -> None:
        from sparrow.training.heads import evaluate_head
        from sparrow.training.trainer import LOG, read_log

        c = head.config
        if not len(held_out):
            evaluation = None
        elif c.arch == "longspec":
            from sparrow.training.longspec import evaluate_longspec

            evaluation = evaluate_longspec(head, loaded.model, held_out, self.settings.ttt_steps)
        else:
            evaluation = evaluate_head(head, held_out, self.settings.ttt_steps)
        rows = read_log(self.out / LOG)
        shape: dict[str, Any] = (
            {"window": c.window, "kv_layer": c.kv_layer, "anchor_offset": self.settings.anchor_offset}
            if c.arch == "longspec" else
            {"draft_vocab_size": c.draft_vocab_size, "target_layers": list(c.target_layers), "fusion": c.fusion,
             "layers": c.num_layers})
        report = {
            "target": self.target_name, "arch": c.arch, **shape, "steps": outcome.step, "stopped": outcome.stopped,
            "train_sequences": len(corpus.train), "train_corpus_tokens": corpus.train_tokens,
            "tokens_seen": sum(r["tokens"] for r in rows), "held_out_sequences": len(held_out),
            "held_out": None if evaluation is None else {
                "loss": evaluation.loss, "agreement_per_depth": list(evaluation.agreement),
                "expected_tokens_per_round": evaluation.expected_accepted},
            **self.timings,
        }
        if c.arch in ("eagle3", "eagle1"):
            report["int8"] = self.export_int8(head)
        self._publish(report, rows, f"{head.config.arch} head for {self.target_name}", outcome, evaluation,
                      f"--drafter eagle --head {self.out}", f"{len(held_out)} sequences")

    def export_int8(self, head: Any) -> dict[str, Any]:
        """OUT/int8: the head's int8 export beside the dense one (replaced at each finish); its size, or why not."""
        from sparrow.heads.layout import export_int8

        try:
            written = export_int8(head, self.out / "int8", replace=True)
        except UserError as error:
            self.say(f"no int8 export: {error}")
            return {"error": str(error)}
        self.say(f"int8 export: {self.out / 'int8'} ({written.total_bytes / 1e6:.1f} MB in {len(written.shard_bytes)} "
                 f"shards; use: --drafter eagle --head {self.out / 'int8'})")
        return {"dir": str(self.out / "int8"), "bytes": written.total_bytes, "shards": len(written.shard_bytes)}

    def _publish(self, report: dict[str, Any], rows: list[dict], title: str, outcome: Any, evaluation: Any,
                 use: str, held_out: str) -> None:
        """eval.json and the plot written; where the head is and how it did on the held-out set said; the
        report printed as one JSON line."""
        from sparrow.training.plot import plot_training

        (self.out / "eval.json").write_text(json.dumps(report, indent=1) + "\n")
        if rows:
            plot_training(rows, self.out / "training.png", title)
        stop = "" if outcome.stopped == "done" else f" (stopped: {outcome.stopped}; --resume continues)"
        self.say(f"step {outcome.step}/{self.settings.steps}{stop}; head saved to {self.out} (use: {use})")
        if evaluation is not None:
            depths = ", ".join(f"{a:.3f}" for a in evaluation.agreement)
            self.say(f"held-out ({held_out}): loss {evaluation.loss:.3f}, top-1 agreement by depth "
                     f"[{depths}], expected tokens per round {evaluation.expected_accepted:.2f}")
        typer.echo(json.dumps(report))

    def bars(self) -> _Bars:
        return _Bars(self.progress)


class _SparrowRun(_Run):
    """`--arch sparrow`: the target's answers about videos, in-memory video features, then the shared training
    (run_training: checkpoints, time budget, resume), a held-out evaluation and the plot."""

    text_window = DEFAULT_TEXT_WINDOW

    def go(self, dtype: str, device: str | None) -> None:
        from dataclasses import replace

        from sparrow.training.video_data import load_answers, read_videos, sample_features, self_distilled_answers
        from sparrow.models import load_model

        spec = self.spec
        self.out.mkdir(parents=True, exist_ok=True)
        videos = read_videos(spec)  # unreadable videos fail before the model loads
        loaded = load_model(self.target_name, dtype=dtype, device=device, progress=self.progress)
        if not loaded.is_vlm:
            raise _video_target_error(self.target_name, "a text-only model (no processor for videos)")
        self.model = loaded.model
        if self.state is None:
            run_dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
            record = {"target": self.target_name, "dtype": run_dtype, "arch": "sparrow", "top_k": None, "features": None}
            (self.out / RUN).write_text(json.dumps(record) + "\n")
        kept = len(load_answers(spec, self.out, self.target_name))
        start = time.monotonic()
        with self.bars() as bars:
            samples = self_distilled_answers(spec, loaded, self.out, self.target_name,
                                             lambda d, t: bars.callback("answers", d, t), self.out_of_time, videos)
        if samples is None:
            self.say(f"time budget spent while the target answered; its answers so far are kept in "
                     f"{self.out / 'video_corpus.json'}: rerun the same command to continue")
            return
        if kept < len(samples):  # the target answered (not all reused from video_corpus.json)
            self.timings["answer_seconds"] = time.monotonic() - start
        train_count = sum(not s.held_out for s in samples)
        self.say(f"videos: {len(spec.videos)} x {len(spec.questions)} questions, {spec.frames} frames each: "
                 f"{train_count} training / {len(samples) - train_count} held-out (video, question) pairs")
        if not self.steps_given and self.state is None:
            self.settings = replace(self.settings, steps=max(1, math.ceil(SPARROW_EPOCHS * train_count
                                                                          / self.settings.batch_size)))
        head = self.sparrow_head(loaded, samples)
        start = time.monotonic()
        with self.bars() as bars:
            features = sample_features(loaded, head, samples, spec, lambda d, t: bars.callback("features", d, t),
                                       self.out_of_time, videos)
        if features is None:
            self.say("time budget spent during feature extraction (features are not cached for --arch sparrow; the "
                     "answers are): rerun the same command to continue")
            return
        self.timings["feature_seconds"] = time.monotonic() - start
        train = [f for f, s in zip(features, samples) if not s.held_out]
        held_out = [f for f, s in zip(features, samples) if s.held_out]
        outcome = self.train(head, train, held_out)
        self.finish_sparrow(head, train, held_out, outcome, samples)

    def sparrow_head(self, loaded: Any, samples: Any) -> Any:
        import torch

        from sparrow.heads.factory import new_head
        from sparrow.training.trainer import resumed_head

        model = loaded.model
        device = next(model.parameters()).device
        if self.state is not None:
            self.say(f"resuming from step {self.state['step']} in {self.out}")
            return resumed_head(self.out, self.state, model, device)
        texts = [torch.tensor(s.answer, dtype=torch.long) for s in samples]
        texts += [torch.tensor(loaded.tokenizer(q)["input_ids"], dtype=torch.long) for q in self.spec.questions]
        ids = self.draft_vocabulary(loaded, [t for t in texts if t.numel()])
        generator = torch.Generator(device=device).manual_seed(self.settings.seed)
        head = new_head(model, "sparrow", generator, draft_vocab=ids, text_window=self.text_window,
                        **self.variant.shape()).float()
        init_from_target(head, model)
        return head

    def finish_sparrow(self, head: Any, train: Any, held_out: Any, outcome: Any, samples: Any) -> None:
        from sparrow.heads.sparrow_head import spec_of
        from sparrow.training.sparrow_head import evaluate_sparrow
        from sparrow.training.trainer import LOG, read_log

        c, sparrow = head.config, spec_of(head)
        evaluation = evaluate_sparrow(head, held_out, self.settings.ttt_steps) if held_out else None
        rows = read_log(self.out / LOG)
        report = {
            "target": self.target_name, "arch": "sparrow", "draft_vocab_size": c.draft_vocab_size,
            "target_layers": list(c.target_layers), "fusion": c.fusion, "layers": c.num_layers,
            "text_window": sparrow.text_window, "bridge_layer": sparrow.bridge_layer,
            "steps": outcome.step, "stopped": outcome.stopped, "videos": list(self.spec.videos),
            "frames": self.spec.frames, "questions": list(self.spec.questions),
            "train_sequences": len(train), "train_positions": sum(f.tokens.numel() for f in train),
            "held_out_sequences": len(held_out),
            "held_out_pairs": [{"video": s.video, "question": s.question} for s in samples if s.held_out],
            "tokens_seen": sum(r["tokens"] for r in rows),
            "first_loss": rows[0]["loss"] if rows else None, "last_loss": rows[-1]["loss"] if rows else None,
            "held_out": None if evaluation is None else {
                "loss": evaluation.loss, "agreement_per_depth": list(evaluation.agreement),
                "expected_tokens_per_round": evaluation.expected_accepted},
            **self.timings,
        }
        self._publish(report, rows, f"sparrow head for {self.target_name}", outcome, evaluation,
                      f"--drafter eagle --head {self.out} with a --video", f"{len(held_out)} (video, question) pairs")


class _Bars:
    """Progress on stderr (none with --no-progress): on a terminal, rich bars, one task per stage name; elsewhere
    (stderr into a log file, where rich draws nothing until a stage ends) one plain line per stage every
    `log_every` seconds and when the stage completes, with the time left at the stage's rate so far."""

    def __init__(self, enabled: bool, log_every: float = 60.0, clock: Any = time.monotonic) -> None:
        self.enabled, self.log_every, self.clock = enabled, log_every, clock
        self.bar: Any = None
        self.tasks: dict[str, int] = {}
        self.first: dict[str, tuple[float, int]] = {}  # plain lines: stage -> (time, done) when first reported
        self.logged: dict[str, float] = {}  # plain lines: stage -> when its last line was printed

    def __enter__(self) -> _Bars:
        if self.enabled and err.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
                TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"),
                                TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=False)
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, stage: str, done: int, total: int, info: str = "") -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            if stage not in self.tasks:
                self.tasks[stage] = self.bar.add_task(stage, total=total, completed=done, info="")
            self.bar.update(self.tasks[stage], completed=done, total=total, info=info)
            return
        now = self.clock()
        start, start_done = self.first.setdefault(stage, (now, done))
        if done < total and now - self.logged.get(stage, start - self.log_every) < self.log_every:
            return
        self.logged[stage] = now
        rate = (done - start_done) / (now - start) if now > start else 0.0
        left = f", about {_duration((total - done) / rate)} left" if rate > 0 and done < total else ""
        err.print(f"{stage}: {done}/{total} after {_duration(now - start)}{left}" + (f"; {info}" if info else ""),
                  markup=False, highlight=False, soft_wrap=True)

    def callback(self, stage: str, done: int, total: int) -> None:
        self.update(stage, done, total)


def _duration(seconds: float) -> str:
    """4h02m, 6m40s, 35s."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def init_from_target(head: Any, model: Any) -> None:
    """`sparrow.training.heads.init_from_target` (imported when used: the CLI starts without torch)."""
    from sparrow.training.heads import init_from_target as start_from_target

    start_from_target(head, model)


def _default_anchor_offset(model: Any, corpus: Any) -> int:
    """LongSpec's offsets (up to ~30k), kept inside the target's position range for the sequences of `corpus`."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(text, "max_position_embeddings", None) or DEFAULT_ANCHOR_OFFSET
    longest = max((t.numel() for t in [*corpus.train, *corpus.held_out]), default=0)
    return max(0, min(DEFAULT_ANCHOR_OFFSET, limit - longest))


def _started_run(out: Path) -> dict[str, Any]:
    """The run.json of a run that has no checkpoint yet, with the recipe `--resume` trains from step 0 (the corpus
    and features it wrote are reused); UserError when there is none."""
    path = out / RUN
    record = json.loads(path.read_text()) if path.is_file() else {}
    if record.get("arch") == "sparrow":
        raise UserError(f"--resume: {str(out)!r} holds no checkpoint yet ({out / 'trainer_state.pt'}): rerun the "
                        "command that started it, without --resume (the answers in video_corpus.json are reused)")
    if "recipe" not in record:
        raise UserError(f"--resume: {str(out)!r} holds no checkpoint ({out / 'trainer_state.pt'}) and no started "
                        f"run ({path}) to continue")
    return record


def _recipe_run(recipe: dict[str, Any], steps: int | None) -> tuple[Any, Any]:
    """The corpus spec and settings of a started run's recipe (--steps, when given, replaces its step count)."""
    from sparrow.training.data import CorpusSpec
    from sparrow.training.trainer import TrainSettings

    settings = TrainSettings(**{**recipe["settings"], **({"steps": steps} if steps is not None else {})})
    return CorpusSpec(**{**recipe["spec"], "roots": tuple(recipe["spec"]["roots"])}), settings


def _stored_run(out: Path, state: dict[str, Any], steps: int | None) -> tuple[Any, Any]:
    """The corpus spec and settings of the run in `out` (--steps, when given, replaces its step count)."""
    from dataclasses import replace

    from sparrow.training.data import CorpusSpec
    from sparrow.training.trainer import TrainSettings

    meta = out / "corpus.json"
    if not meta.is_file():
        raise UserError(f"--resume: {str(out)!r} has a checkpoint but no corpus.json; it was not made by "
                        "`sparrow train head`")
    fields = json.loads(meta.read_text())["spec"]
    fields["roots"] = tuple(fields["roots"])
    settings = TrainSettings(**state["settings"])
    return CorpusSpec(**fields), replace(settings, steps=steps) if steps is not None else settings
