"""The stages of a `sparrow train head` run on this machine (corpus, cached features, the head, training by
sparrow.training.orchestrator, the report and int8 export; the Sparrow head's video stages), resumable. Its flags
are resolved by sparrow.cli.train, its progress shown by a `Console` (sparrow.cli.train_run: rich bars or plain
lines). It imports the loader and the trainers only when a run starts."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from sparrow.errors import UserError
from sparrow.training.orchestrator import check_out

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



class Console(Protocol):
    """Where a run's progress goes."""

    progress: bool  # progress bars wanted (also the loader's)

    def say(self, message: str) -> None:
        """One line for the user."""

    def bars(self) -> Any:
        """A context manager whose value has `update(stage, done, total, info="")` and `callback(stage, done,
        total)`."""

    def echo(self, line: str) -> None:
        """The run's report, one JSON line on stdout."""


class HeadRun:
    """One invocation of `sparrow train head`: the stages in order, sharing the loaded target and a console."""

    def __init__(self, out: Path, target: str, spec: Any, settings: Any, state: dict[str, Any] | None, arch: str,
                 draft_vocab: int | None, top_k: int, features: Path, deadline: float | None, console: Console,
                 steps_given: bool, variant: HeadVariant = HeadVariant(), distill_batch: int | None = None) -> None:
        self.out, self.target_name, self.spec, self.settings, self.state = out, target, spec, settings, state
        self.arch, self.draft_vocab, self.top_k, self.features_dir = arch, draft_vocab, top_k, features
        self.deadline, self.console, self.steps_given, self.variant = deadline, console, steps_given, variant
        self.distill_batch = distill_batch  # None: by device (`corpus`)
        self.model: Any = None  # the loaded target's transformers model (set by `go`)
        self.timings: dict[str, float] = {}

    def say(self, message: str) -> None:
        self.console.say(message)

    def record(self, loaded: Any, **fields: Any) -> None:
        """OUT/run.json: the target, its dtype, the arch and `fields` (what a resume needs beyond a checkpoint)."""
        dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
        (self.out / RUN).write_text(json.dumps({"target": self.target_name, "dtype": dtype, "arch": self.arch,
                                                **fields}) + "\n")

    def load(self, dtype: str, device: str | None) -> Any:
        """The target (a LoadedModel), OUT made."""
        from sparrow.models import load_model

        self.out.mkdir(parents=True, exist_ok=True)
        loaded = load_model(self.target_name, dtype=dtype, device=device, progress=self.console.progress)
        self.model = loaded.model
        return loaded

    def default_steps(self, epochs: int, sequences: int) -> None:
        """A new run without --steps: `epochs` passes over its `sequences` training sequences."""
        if not self.steps_given and self.state is None:
            batches = math.ceil(epochs * sequences / self.settings.batch_size)
            self.settings = replace(self.settings, steps=max(1, batches))

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def go(self, dtype: str, device: str | None) -> None:
        loaded = self.load(dtype, device)
        if self.state is None:  # what `--resume` needs before the first checkpoint
            recipe = {"spec": asdict(self.spec), "settings": asdict(self.settings), "steps_given": self.steps_given,
                      "variant": asdict(self.variant), "draft_vocab": self.draft_vocab}
            features = None if self.features_dir == self.out / "features" else str(self.features_dir.resolve())
            self.record(loaded, top_k=self.top_k, features=features, recipe=recipe)
        corpus = self.corpus(loaded)
        self.default_steps(2, len(corpus.train))
        if self.arch == "longspec" and self.state is None and not self.variant.anchor_offset_given:
            self.settings = replace(self.settings, anchor_offset=default_anchor_offset(loaded.model, corpus))
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
        if self.state is not None:
            return self.resumed(loaded.model)
        ids = self.draft_vocabulary(loaded, corpus.train) if self.arch == "eagle3" else None
        return self.fresh(loaded.model, ids, **({} if self.arch == "longspec" else self.variant.shape()))

    def fresh(self, model: Any, ids: Any, **shape: Any) -> Any:
        from sparrow.training.heads import fresh_head

        return fresh_head(model, self.arch, self.settings.seed, ids, init=self.settings.init_from_target, **shape)

    def resumed(self, model: Any) -> Any:
        from sparrow.training.trainer import resumed_head

        assert self.state is not None
        self.say(f"resuming from step {self.state['step']} in {self.out}")
        return resumed_head(self.out, self.state, model, next(model.parameters()).device)

    def draft_vocabulary(self, loaded: Any, sequences: Any) -> Any:
        """FR-Spec: the target ids of the draft vocabulary, the --draft-vocab (default DEFAULT_DRAFT_VOCAB, at most
        the target's vocabulary) most frequent tokens of `sequences` ([n] target ids each), EOS ids included."""
        from sparrow.training.heads import frequent_tokens

        vocab = loaded.model.get_output_embeddings().weight.shape[0]
        size = min(self.draft_vocab or DEFAULT_DRAFT_VOCAB, vocab)
        return frequent_tokens(
            sequences, size, vocab, always=sorted(i for i in loaded.eos_token_ids() if 0 <= i < vocab)
        )

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
        c = head.config
        shape: dict[str, Any] = (
            {"window": c.window, "kv_layer": c.kv_layer, "anchor_offset": self.settings.anchor_offset}
            if c.arch == "longspec" else
            {"draft_vocab_size": c.draft_vocab_size, "target_layers": list(c.target_layers), "fusion": c.fusion,
             "layers": c.num_layers})
        fields = {**shape, "train_sequences": len(corpus.train), "train_corpus_tokens": corpus.train_tokens}
        if c.arch in ("eagle3", "eagle1"):
            fields["int8"] = self.export_int8(head)
        self._publish(fields, outcome, len(held_out), f"--drafter eagle --head {self.out}",
                      f"{len(held_out)} sequences")

    def export_int8(self, head: Any) -> dict[str, Any]:
        """OUT/int8: the head's int8 export beside the dense one (replaced at each finish); its size, or why not."""
        from sparrow.training.orchestrator import export

        try:
            written = export(head, self.out / "int8", 8)
        except UserError as error:
            self.say(f"no int8 export: {error}")
            return {"error": str(error)}
        self.say(f"int8 export: {written['dir']} ({written['bytes'] / 1e6:.1f} MB in {written['shards']} shards; "
                 f"use: --drafter eagle --head {written['dir']})")
        return written

    def _publish(self, fields: dict[str, Any], outcome: Any, held_out_count: int, use: str, held_out: str) -> None:
        """eval.json (the arch's `fields`, where training stopped, the held-out evaluation) and the plot written;
        where the head is and how it did on the held-out set said; the report printed as one JSON line."""
        from sparrow.training.orchestrator import write_report
        from sparrow.training.plot import plot_training
        from sparrow.training.trainer import LOG, read_log

        rows = read_log(self.out / LOG)
        report = {"target": self.target_name, "arch": self.arch, **fields, "steps": outcome.step,
                  "stopped": outcome.stopped, "tokens_seen": sum(r["tokens"] for r in rows),
                  "held_out_sequences": held_out_count, "first_loss": rows[0]["loss"] if rows else None,
                  "last_loss": rows[-1]["loss"] if rows else None, **self.timings}
        evaluation = outcome.evaluation
        report["held_out"] = None if evaluation is None else evaluation.record()
        write_report(self.out, report)
        if rows:
            plot_training(rows, self.out / "training.png", f"{self.arch} head for {self.target_name}")
        stop = "" if outcome.stopped == "done" else f" (stopped: {outcome.stopped}; --resume continues)"
        self.say(f"step {outcome.step}/{self.settings.steps}{stop}; head saved to {self.out} (use: {use})")
        if evaluation is not None:
            depths = ", ".join(f"{a:.3f}" for a in evaluation.agreement)
            self.say(f"held-out ({held_out}): loss {evaluation.loss:.3f}, top-1 agreement by depth "
                     f"[{depths}], expected tokens per round {evaluation.expected_accepted:.2f}")
        self.console.echo(json.dumps(report))

    def bars(self) -> Any:
        return self.console.bars()


class VideoHeadRun(HeadRun):
    """`--arch sparrow`: the target's answers about videos, in-memory video features, then the shared training
    (run_training: checkpoints, time budget, resume), a held-out evaluation and the plot."""

    text_window = DEFAULT_TEXT_WINDOW

    def go(self, dtype: str, device: str | None) -> None:
        from sparrow.training.video_data import load_answers, read_videos, sample_features, self_distilled_answers

        spec = self.spec
        videos = read_videos(spec)  # unreadable videos fail before the model loads
        loaded = self.load(dtype, device)
        if not loaded.is_vlm:
            raise video_target_error(self.target_name, "a text-only model (no processor for videos)")
        if self.state is None:
            self.record(loaded, top_k=None, features=None)
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
        self.default_steps(SPARROW_EPOCHS, train_count)
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

        if self.state is not None:
            return self.resumed(loaded.model)
        texts = [torch.tensor(s.answer, dtype=torch.long) for s in samples]
        texts += [torch.tensor(loaded.tokenizer(q)["input_ids"], dtype=torch.long) for q in self.spec.questions]
        ids = self.draft_vocabulary(loaded, [t for t in texts if t.numel()])
        return self.fresh(loaded.model, ids, text_window=self.text_window, **self.variant.shape())

    def finish_sparrow(self, head: Any, train: Any, held_out: Any, outcome: Any, samples: Any) -> None:
        from sparrow.heads.sparrow_head import spec_of

        c, sparrow = head.config, spec_of(head)
        fields = {
            "draft_vocab_size": c.draft_vocab_size, "target_layers": list(c.target_layers), "fusion": c.fusion,
            "layers": c.num_layers, "text_window": sparrow.text_window, "bridge_layer": sparrow.bridge_layer,
            "videos": list(self.spec.videos), "frames": self.spec.frames, "questions": list(self.spec.questions),
            "train_sequences": len(train), "train_positions": sum(f.tokens.numel() for f in train),
            "held_out_pairs": [{"video": s.video, "question": s.question} for s in samples if s.held_out],
        }
        self._publish(fields, outcome, len(held_out), f"--drafter eagle --head {self.out} with a --video",
                      f"{len(held_out)} (video, question) pairs")


def default_anchor_offset(model: Any, corpus: Any) -> int:
    """LongSpec's offsets (up to ~30k), kept inside the target's position range for the sequences of `corpus`."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(text, "max_position_embeddings", None) or DEFAULT_ANCHOR_OFFSET
    longest = max((t.numel() for t in [*corpus.train, *corpus.held_out]), default=0)
    return max(0, min(DEFAULT_ANCHOR_OFFSET, limit - longest))


def read_record(out: Path) -> dict[str, Any]:
    """OUT/run.json ({} when there is none)."""
    return json.loads((out / RUN).read_text()) if (out / RUN).is_file() else {}


def started_run(out: Path) -> dict[str, Any]:
    """The run.json of a run that has no checkpoint yet, with the recipe `--resume` trains from step 0 (the corpus
    and features it wrote are reused); UserError when there is none."""
    path, record = out / RUN, read_record(out)
    if record.get("arch") == "sparrow":
        raise UserError(f"--resume: {str(out)!r} holds no checkpoint yet ({out / 'trainer_state.pt'}): rerun the "
                        "command that started it, without --resume (the answers in video_corpus.json are reused)")
    if "recipe" not in record:
        check_out(out, True, None, f" ({out / 'trainer_state.pt'}) and no started run ({path})")
    return record


def recipe_run(recipe: dict[str, Any], steps: int | None) -> tuple[Any, Any]:
    """The corpus spec and settings of a started run's recipe (--steps, when given, replaces its step count)."""
    from sparrow.training.data import CorpusSpec
    from sparrow.training.trainer import TrainSettings

    settings = TrainSettings(**{**recipe["settings"], **({"steps": steps} if steps is not None else {})})
    return CorpusSpec(**{**recipe["spec"], "roots": tuple(recipe["spec"]["roots"])}), settings


def stored_run(out: Path, state: dict[str, Any], steps: int | None) -> tuple[Any, Any]:
    """The corpus spec and settings of the run in `out` (--steps, when given, replaces its step count)."""
    meta = out / "corpus.json"
    if not meta.is_file():
        raise UserError(f"--resume: {str(out)!r} has a checkpoint but no corpus.json; it was not made by "
                        "`sparrow train head`")
    return recipe_run({"spec": json.loads(meta.read_text())["spec"], "settings": state["settings"]}, steps)


def video_target_error(target: str, why: str) -> UserError:
    return UserError(f"--arch sparrow needs a Video-LLM --target: a directory (or hub id) of a Qwen2.5-VL or "
                     f"LLaVA-OneVision model with its processor; --target {target!r} is {why}")
