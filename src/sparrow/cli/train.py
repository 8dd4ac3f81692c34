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
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from sparrow.cli._common import DTYPE_HELP, DType, check_float, check_int, cli_errors, err
from sparrow.cli.train_run import TerminalConsole
from sparrow.errors import UserError
from sparrow.training.head_run import (
    DEFAULT_ANCHOR_OFFSET,
    DEFAULT_DISTILL,
    DEFAULT_DRAFT_VOCAB,
    DEFAULT_FRAMES,
    DEFAULT_SEQ_LEN,
    DEFAULT_TARGET,
    DEFAULT_TEXT_WINDOW,
    DEFAULT_TOKENS,
    DEFAULT_TOP_K,
    SPARROW_EPOCHS,
    TEXT_CORPUS_OPTIONS,
    VIDEO_OPTIONS,
    HeadRun,
    HeadVariant,
    VideoHeadRun,
    read_record,
    recipe_run,
    started_run,
    stored_run,
    video_target_error,
)

train_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                        help="Train draft heads for a target on this machine.", no_args_is_help=True)



@train_app.command("head")
@cli_errors
def head(
    out: Annotated[Optional[Path], typer.Option(
        help="Run directory: the head (eagle3: SpecForge's EAGLE-3 layout; every arch loads with --drafter eagle "
        "--head OUT), checkpoints, features, log, plot. Default for a preset target: <sparrow cache>/heads/<preset>, "
        "where --drafter eagle finds it without --head.")] = None,
    target: Annotated[
        Optional[str],
        typer.Option(help=f"Target model: preset, local dir or hub id (default {DEFAULT_TARGET}; --arch sparrow: a "
                     "Qwen2.5-VL or LLaVA-OneVision directory or hub id; with --resume, the run's)."),
    ] = None,
    arch: Annotated[Optional[str], typer.Option(
        help="eagle3 (three fused target layers, own reduced LM head), eagle1 (last layer, the target's LM head), "
        "longspec (sliding-window self-attention + cross-attention over the target's KV cache; trains at "
        "anchor-offset positions) or sparrow (Video-LLM targets, Qwen2.5-VL / LLaVA-OneVision: an EAGLE-3 head with "
        "no visual KV and a text window, trained on the target's answers about --videos). Default eagle3; with "
        "--resume, the run's.")] = None,
    fusion: Annotated[Optional[str], typer.Option(
        help="How eagle3/eagle1/sparrow heads mix feature and token embedding: concat (EAGLE; vLLM/SGLang read it) "
        "or gated (Dovetail's gating fusion; sparrow-only tensors gate.*). Default concat.")] = None,
    layers: Annotated[Optional[int], typer.Option(
        help="Decoder layers of an eagle3/eagle1/sparrow head (Dovetail: deeper heads; > 1 is sparrow-only: "
        "layers.1.* tensors). Default 1.")] = None,
    intermediate_size: Annotated[Optional[int], typer.Option(
        help="MLP width of an eagle3/eagle1/sparrow head's decoder layer (default: the target's, as SpecForge's "
        "heads; smaller heads draft cheaper on a CPU).")] = None,
    anchor_offset: Annotated[
        Optional[int],
        typer.Option(help="longspec: shift training positions (after 0-4 sink tokens) by a random offset up to N, so "
                     "short text trains long-context positions (LongSpec's anchor-offset indices; default "
                     f"min({DEFAULT_ANCHOR_OFFSET}, the target's max positions - the longest training sequence))."),
    ] = None,
    draft_vocab: Annotated[
        Optional[int],
        typer.Option(help="eagle3, sparrow: the N most frequent target tokens of the training data (FR-Spec; "
                     f"default {DEFAULT_DRAFT_VOCAB}, at most the vocabulary)."),
    ] = None,
    videos: Annotated[Optional[list[Path]], typer.Option(
        help="sparrow: a video file (any the video reader takes, e.g. .mp4/.avi), a directory of video files, or a "
        "directory of frame images (repeatable; default: opencv-doc's sample videos under "
        "/usr/share/doc/opencv-doc/examples/data).")] = None,
    frames: Annotated[
        Optional[int],
        typer.Option(help=f"sparrow: frames sampled uniformly from each video (default {DEFAULT_FRAMES})."),
    ] = None,
    text_window: Annotated[
        Optional[int],
        typer.Option(help=f"sparrow: text rows each head row attends to (Sparrow's text-anchored window; default "
                     f"{DEFAULT_TEXT_WINDOW})."),
    ] = None,
    data: Annotated[Optional[list[Path]], typer.Option(
        help="Directory or file of .py/.md/.rst text (repeatable; default: the standard library and installed "
        "packages).")] = None,
    tokens: Annotated[
        Optional[int],
        typer.Option(help=f"Training tokens taken from files (self-distilled answers come on top; default "
                     f"{DEFAULT_TOKENS})."),
    ] = None,
    held_out_tokens: Annotated[Optional[int], typer.Option(
        help="Held-out tokens from other files (default: tokens / 20, at least 2 sequences).")] = None,
    held_out_percent: Annotated[int, typer.Option(
        help="Share of files (by a hash of their path) held out for evaluation; sparrow: of the (video, question) "
        "pairs (at least one).")] = 5,
    seq_len: Annotated[
        Optional[int], typer.Option(help=f"Tokens per training sequence (default {DEFAULT_SEQ_LEN}).")
    ] = None,
    distill: Annotated[
        Optional[int],
        typer.Option(help="Self-distilled sequences: the target's greedy answers to prompts built from training files "
                     f"(held out: a tenth; default {DEFAULT_DISTILL})."),
    ] = None,
    distill_tokens: Annotated[int, typer.Option(
        help="New tokens per self-distilled answer (sparrow: per answer about a video).")] = 128,
    distill_batch: Annotated[Optional[int], typer.Option(
        help="Self-distilled answers generated together (transformers' batched greedy generate over left-padded "
        "prompts); default 32 on a GPU, 16 on a CPU (qwen2.5-coder-1.5b, bf16, AMD EPYC, 2 threads: 40 tokens/s at "
        "16 against 4 one at a time); 1 = sparrow's plain decoding, one answer at a time.")] = None,
    steps: Annotated[
        Optional[int],
        typer.Option(help=f"Optimiser steps in total (default: 2 epochs of the training sequences; sparrow: "
                     f"{SPARROW_EPOCHS} epochs of its training pairs)."),
    ] = None,
    time_budget: Annotated[
        Optional[float],
        typer.Option(help="Seconds for the whole command; stops cleanly (checkpoint, cache) when spent; --resume "
                     "continues."),
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Sequences per optimiser step.")] = 4,
    ttt_steps: Annotated[int, typer.Option(
        help="Training-time-test depth: draft steps trained on the head's own features (EAGLE-3).")] = 3,
    lr: Annotated[float, typer.Option(help="Learning rate (after a linear warmup).")] = 5e-4,
    optimizer: Annotated[str, typer.Option(
        help="adamw (EAGLE-3's) or muon (Muon on the 2-D weight matrices, AdamW on the rest; measured level with "
        "AdamW only at ~10x its learning rate, docs/heads.md).")] = "adamw",
    init_from_target: Annotated[Optional[str], typer.Option(
        help="What a new head takes from its target: none; lm_head (its final norm and the LM-head rows of the draft "
        "vocabulary); layer (those and its last decoder layer; EAGLE-3 heads with concatenation fusion). Default: "
        "layer where the head can take it, else lm_head.")] = None,
    top_k: Annotated[
        Optional[int],
        typer.Option(help="Soft labels kept per position: the target's top-k log-probs (default 32; with --resume, "
                     "the run's)."),
    ] = None,
    checkpoint_every: Annotated[int, typer.Option(help="Save a checkpoint every N steps.")] = 100,
    eval_every: Annotated[int, typer.Option(help="Held-out evaluation every N steps.")] = 50,
    seed: Annotated[int, typer.Option(
        help="Seed of the file sample, the head's initial weights and the data order.")] = 0,
    features: Annotated[Optional[Path], typer.Option(
        help="Feature cache directory (default OUT/features, or the resumed run's; share one between runs of the "
        "same target and layers).")] = None,
    resume: Annotated[
        bool,
        typer.Option(help="Continue the run in OUT from its last checkpoint (its corpus and recipe; --steps may "
                     "extend it)."),
    ] = False,
    dtype: Annotated[
        DType, typer.Option(help=DTYPE_HELP + " The head trains in float32. With --resume, auto = the run's.")
    ] = DType.auto,
    device: Annotated[Optional[str], typer.Option(help="Default: cuda if available, else cpu.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Rich progress bars on stderr.")] = True,
) -> None:
    """Train a draft head on the target's own outputs: EAGLE-3 (FR-Spec draft vocabulary, training-time test),
    EAGLE-1, Dovetail's gated / deeper variants, a LongSpec head, or (Video-LLM targets) a Sparrow head trained on
    the target's answers about --videos; checkpoints, resume, held-out evaluation."""
    from sparrow.training.data import CorpusSpec, default_roots
    from sparrow.training.heads import default_init
    from sparrow.training.orchestrator import check_out
    from sparrow.training.trainer import STATE, TrainSettings, read_state

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
    begun = started_run(out) if resume and state is None else None  # killed before its first checkpoint
    stored_arch = _arch_of(state) if resume and state is not None else begun["arch"] if begun else None
    _check_variant(arch or stored_arch or "eagle3", fusion, layers, draft_vocab, anchor_offset, intermediate_size)
    _check_data_options(arch or stored_arch or "eagle3", {
        name for name, value in (("data", data), ("tokens", tokens), ("held_out_tokens", held_out_tokens),
                                 ("seq_len", seq_len), ("distill", distill), ("distill_batch", distill_batch),
                                 ("top_k", top_k), ("features", features),
                                 ("videos", videos), ("frames", frames), ("text_window", text_window))
        if value is not None})
    if not resume:
        check_out(out, resume, out / STATE if state is not None else None)
    fitting = default_init(arch or stored_arch or "eagle3", fusion or "concat")
    init = init_from_target or fitting
    if init == "layer" and fitting != "layer":
        raise UserError("--init-from-target layer needs an EAGLE-3 head with concatenation fusion (--arch eagle3, "
                        "--fusion concat)")
    fresh = None if resume else TrainSettings(steps=steps or 1, lr=lr, batch_size=batch_size, ttt_steps=ttt_steps,
                                              checkpoint_every=checkpoint_every, eval_every=eval_every, seed=seed,
                                              anchor_offset=anchor_offset or 0, init_from_target=init,
                                              optimizer=optimizer)
    stored = read_record(out) if resume else {}  # the run's target, dtype, top-k and feature cache
    target = target or stored.get("target")
    if dtype == DType.auto and stored.get("dtype"):
        dtype = DType(stored["dtype"])
    if (arch or stored_arch) == "sparrow":
        _sparrow(out, target, state, resume, steps, time_budget, started, dtype, device, progress, draft_vocab,
                 HeadVariant(fusion or "concat", layers or 1, intermediate_size=intermediate_size), videos, frames,
                 text_window, held_out_percent, distill_tokens, fresh, seed, arch, fusion, layers)
        return
    variant = HeadVariant(fusion or "concat", layers or 1, anchor_offset is not None, intermediate_size)
    steps_given = steps is not None
    if resume and begun is not None:  # no checkpoint yet: step 0 of the run's recipe, its corpus and features
        recipe = begun["recipe"]
        variant = HeadVariant(**recipe["variant"])
        _check_resumed_variant(_started_variant(begun), arch, fusion, layers, anchor_offset, intermediate_size,
                               draft_vocab)
        spec, settings = recipe_run(recipe, steps)
        draft_vocab, steps_given = recipe["draft_vocab"], steps_given or recipe["steps_given"]
    elif resume:
        _check_resumed_variant(_checkpoint_variant(state), arch, fusion, layers, anchor_offset, intermediate_size)
        spec, settings = stored_run(out, state, steps)
    if resume:
        top_k = top_k or stored.get("top_k")
        features = features or (Path(stored["features"]) if stored.get("features") else None)
    else:
        tokens = DEFAULT_TOKENS if tokens is None else tokens
        seq_len = DEFAULT_SEQ_LEN if seq_len is None else seq_len
        distill = DEFAULT_DISTILL if distill is None else distill
        spec = CorpusSpec(roots=tuple(str(p) for p in data) if data else tuple(map(str, default_roots())),
                          tokens=tokens, held_out_tokens=held_out_tokens if held_out_tokens is not None
                          else max(tokens // 20, 2 * seq_len), sequence_length=seq_len, distill=distill,
                          held_out_percent=held_out_percent,
                          distill_tokens=distill_tokens, seed=seed)
        settings = fresh
    run = HeadRun(out, target or DEFAULT_TARGET, spec, settings, state, stored_arch or arch or "eagle3", draft_vocab,
                  top_k or DEFAULT_TOP_K, features or out / "features", deadline, TerminalConsole(progress),
                  steps_given=steps_given, variant=variant, distill_batch=distill_batch)
    run.go(dtype.value, device)


_EXPORT_HEAD_HELP = "A dense head directory (config.json + model.safetensors: saved by `sparrow train head` or " \
    "exported by SpecForge)."


@train_app.command("export-int8")
@cli_errors
def export_int8(
    head: Annotated[Path, typer.Option(help=_EXPORT_HEAD_HELP)],
    out: Annotated[Path, typer.Option(
        help="New directory for the int8 export: manifest.json + int8 safetensors shards of at most 15 MB, 60 MB in "
        "all; loads with --drafter eagle --head OUT.")],
) -> None:
    """Write a head's per-channel int8 export (symmetric per-row scales; norms and maps kept as they are), which
    --drafter eagle --head loads transparently, dequantized to the target's dtype."""
    _export(head, out, 8)


@train_app.command("export-int4")
@cli_errors
def export_int4(
    head: Annotated[Path, typer.Option(help=_EXPORT_HEAD_HELP)],
    out: Annotated[Path, typer.Option(
        help="New directory for the int4 export: manifest.json + int4 safetensors shards of at most 15 MB, 16 MB in "
        "all; loads with --drafter eagle --head OUT.")],
) -> None:
    """Write a head's int4 export (symmetric, a float16 scale per group of 64 inputs of a row; norms and maps kept
    as they are), which --drafter eagle --head loads transparently, dequantized to the target's dtype."""
    _export(head, out, 4)


def _export(head: Path, out: Path, bits: int) -> None:
    from sparrow.heads.layout import export_quantized

    written = export_quantized(head, out, bits=bits)
    typer.echo(json.dumps({"out": str(out), "head_id": written.head_id, "bits": bits,
                           "shards": len(written.shard_bytes), "bytes": written.total_bytes}))


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
        raise UserError(
            "--draft-vocab applies to --arch eagle3 only (an EAGLE-1 head drafts with the target's LM head)"
        )


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
        raise video_target_error(DEFAULT_TARGET, "the default, a text-only preset (give --target)")
    why = _text_only_target(target)
    if why is not None:
        raise video_target_error(target, why)


def _sparrow(out: Path, target: str | None, state: dict[str, Any] | None, resume: bool, steps: int | None,
             time_budget: float | None, started: float, dtype: DType, device: str | None, progress: bool,
             draft_vocab: int | None, variant: HeadVariant, videos: list[Path] | None, frames: int | None,
             text_window: int | None, held_out_percent: int, distill_tokens: int, fresh: Any, seed: int,
             arch: str | None, fusion: str | None, layers: int | None) -> None:
    """`sparrow train head --arch sparrow`: checks before any model loads, then a VideoHeadRun (`fresh`: a new
    run's TrainSettings)."""
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
        settings = TrainSettings(**state["settings"])
        settings = replace(settings, steps=steps) if steps is not None else settings
    else:
        _check_video_target(target)
        spec = VideoSpec(tuple(video_sources(videos)) if videos else tuple(str(p) for p in default_videos()),
                         frames=frames or DEFAULT_FRAMES, answer_tokens=distill_tokens,
                         held_out_percent=held_out_percent, seed=seed)
        settings = fresh
    _check_video_target(target)
    deadline = None if time_budget is None else started + time_budget
    run = VideoHeadRun(out, target, spec, settings, state, "sparrow", draft_vocab, DEFAULT_TOP_K, out / "features",
                       deadline, TerminalConsole(progress), steps_given=steps is not None, variant=variant)
    run.text_window = text_window or DEFAULT_TEXT_WINDOW
    run.go(dtype.value, device)


