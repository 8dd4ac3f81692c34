"""Pipeline: a loaded target (and drafter) that turns prompts into GenerationResults.

    pipe = sparrow.load("qwen2.5-coder-1.5b", drafter="draft-model", draft="qwen2.5-coder-0.5b")
    result = pipe.generate("def fib(n):", max_new_tokens=64)
    baseline = pipe.generate_plain("def fib(n):", max_new_tokens=64)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from sparrow.baseline import plain_decode
from sparrow.config import SamplingConfig, StoppingConfig
from sparrow.drafters.base import Drafter
from sparrow.drafters.registry import REGISTRY, build_drafter, check_drafter_args
from sparrow.engine import speculative_decode
from sparrow.models import LoadedModel, load_model
from sparrow.policy import follow_cost_curve
from sparrow.quantization import check_quant_args, quantized_copy
from sparrow.runner import runner_for
from sparrow.stopping import Stopper
from sparrow.types import GenerationResult, GenerationStats, Prompt
from sparrow.verifiers import VERIFIERS, build_verifier
from sparrow.errors import UserError

@dataclass(frozen=True)
class Request:
    """A validated generation request (the prompt already tokenized)."""

    prompt: Prompt
    sampling: SamplingConfig
    stopping: StoppingConfig
    seed: int | None


class Pipeline:
    def __init__(self, target: LoadedModel, drafter: Drafter | None, verifier: str = "auto") -> None:
        self.target = target
        self.runner = runner_for(target.model)
        self.drafter = drafter
        self.verifier = verifier
        if verifier not in ("auto", *VERIFIERS):
            raise UserError(f"unknown verifier {verifier!r}; expected one of: auto, {', '.join(VERIFIERS)}")

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.target.tokenizer

    @property
    def drafter_name(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    def eos_token_ids(self) -> frozenset[int]:
        ids = self.target.model.generation_config.eos_token_id
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def encode(self, prompt: str | Sequence[int], chat: bool = False, *, video=None, frames: int | None = None,
               image=None) -> Prompt:
        """Tokenize a prompt; with video (file, frame dir, array) / image (file(s)), run the VLM's processor."""
        if video is not None or image is not None or frames is not None:
            from sparrow.vision.prompt import encode_media

            return encode_media(self.target.processor, prompt, video=video, frames=frames, image=image,
                                model_name=f"target {self.target.name!r}")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise UserError("prompt must not be empty")
            if chat and self.tokenizer.chat_template:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                    return_dict=False)
            else:
                ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
            if not ids:
                raise UserError("prompt must not be empty")
        if any(not 0 <= int(t) < self.runner.vocab_size for t in ids):
            raise UserError(f"prompt token ids must lie in [0, {self.runner.vocab_size})")
        return Prompt(input_ids=torch.tensor(ids, dtype=torch.long))

    def request(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
                chat: bool = False, video=None, frames: int | None = None, image=None) -> Request:
        sampling = SamplingConfig(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
        stopping = StoppingConfig(max_new_tokens=max_new_tokens, eos_token_ids=self.eos_token_ids(),
                                  stop_strings=tuple(stop))
        encoded = self.encode(prompt, chat, video=video, frames=frames, image=image)
        context = self.runner.context_length
        n = encoded.input_ids.numel()
        if context is not None and n >= context:
            raise UserError(f"prompt is {n} tokens long, but the model's context is {context} tokens")
        if context is not None and n + max_new_tokens > context:
            raise UserError(f"max_new_tokens={max_new_tokens} with a {n}-token prompt exceeds the model's "
                             f"context of {context} tokens (at most {context - n} new tokens)")
        return Request(encoded, sampling, stopping, seed)

    def generate(self, prompt: str | Sequence[int], **options) -> GenerationResult:
        """Speculative generation (plain decoding when the pipeline has no drafter)."""
        return self._run(self.request(prompt, **options), speculative=True)

    def generate_plain(self, prompt: str | Sequence[int], **options) -> GenerationResult:
        """Plain autoregressive decoding of the same target: the oracle and the baseline."""
        return self._run(self.request(prompt, **options), speculative=False)

    def _run(self, request: Request, speculative: bool) -> GenerationResult:
        generator = None
        if request.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(request.seed)
        stopper = Stopper(request.stopping, self.tokenizer)
        start = time.perf_counter()
        if speculative and self.drafter is not None:
            verifier = build_verifier(self.verifier, request.sampling, tokenizer=self.tokenizer)
            decoded = speculative_decode(self.runner, self.drafter, verifier, request.prompt, request.sampling,
                                         stopper, generator)
        else:
            decoded = plain_decode(self.runner, request.prompt, request.sampling, stopper, generator)
        seconds = time.perf_counter() - start
        return GenerationResult(token_ids=decoded.token_ids, text=stopper.text(), finish_reason=decoded.finish_reason,
                                seconds=seconds, stats=decoded.stats)


def load(target: str | LoadedModel = "qwen2.5-coder-1.5b", *, drafter: str = "draft-model",
         draft: str | LoadedModel | None = "default", num_draft_tokens: int | None = None,
         adaptive: bool = True, verifier: str = "auto", dtype: str = "bfloat16", device: str | None = None,
         progress: bool = True, quant: str | None = None, draft_quant: str | None = None,
         **drafter_options) -> Pipeline:
    """Load a target (and a draft model when the drafter needs or uses one) and build a Pipeline.

    draft: preset, path or hub id, a LoadedModel, None (no draft), or "default" (qwen2.5-coder-0.5b for
    draft-model / cross-vocab / auto; none for visual-prune, which then drafts with the pruned target).

    quant: int8 | int4 weight-only target (lossless only relative to the quantized target).
    draft_quant: int8 | int4 draft model, or the bits of the "quantized-self" copy (default int4).
    """
    if drafter == "quantized-self" and draft_quant is not None:
        drafter_options.setdefault("bits", draft_quant)
    check_drafter_args(drafter, num_draft_tokens, drafter_options)  # before any model is loaded
    entry = REGISTRY.get(drafter)  # None: "none"
    if isinstance(draft, str) and draft == "default":  # the drafter's own default (none for self-drafters)
        draft = entry.default_draft if entry is not None else None
    needs_draft = entry is not None and entry.takes_draft_model
    check_quant_args(drafter, quant, draft_quant, needs_draft)  # before any model is loaded
    if isinstance(target, str):
        target = load_model(target, dtype=dtype, device=device, progress=progress)
    if quant is not None:
        target = quantized_copy(target, quant)
    if needs_draft and isinstance(draft, str):
        draft = load_model(draft, dtype=dtype, device=device, progress=progress)
    if needs_draft and draft is not None and draft_quant is not None:
        draft = quantized_copy(draft, draft_quant, keep_dense=True)  # dense prefill: a draft never changes the output
    built = build_drafter(drafter, target, draft if needs_draft else None, num_draft_tokens, adaptive,
                          **drafter_options)
    if quant is not None or draft_quant is not None:  # quantized kernels: k follows the measured cost curve
        follow_cost_curve(built, runner_for(target.model))
    return Pipeline(target, built, verifier)


__all__ = ["Pipeline", "Request", "load", "build_drafter", "GenerationStats"]
