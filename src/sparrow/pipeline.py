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
from sparrow.cached_model import CachedModel
from sparrow.config import SamplingConfig, StoppingConfig
from sparrow.drafters import DRAFTERS, Drafter, DraftModelDrafter, PromptLookupDrafter
from sparrow.engine import speculative_decode
from sparrow.models import LoadedModel, load_model
from sparrow.stopping import Stopper
from sparrow.types import GenerationResult, GenerationStats, Prompt
from sparrow.verifiers import VERIFIERS, build_verifier

DEFAULT_NUM_DRAFT_TOKENS = {"draft-model": 6, "prompt-lookup": 8}


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
        self.runner = CachedModel(target.model)
        self.drafter = drafter
        self.verifier = verifier
        if verifier not in ("auto", *VERIFIERS):
            raise ValueError(f"unknown verifier {verifier!r}; expected one of: auto, {', '.join(VERIFIERS)}")

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

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> Prompt:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt must not be empty")
            if chat and self.tokenizer.chat_template:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                    return_dict=False)
            else:
                ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt must not be empty")
        if any(not 0 <= int(t) < self.runner.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.runner.vocab_size})")
        return Prompt(input_ids=torch.tensor(ids, dtype=torch.long))

    def request(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
                chat: bool = False) -> Request:
        sampling = SamplingConfig(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
        stopping = StoppingConfig(max_new_tokens=max_new_tokens, eos_token_ids=self.eos_token_ids(),
                                  stop_strings=tuple(stop))
        encoded = self.encode(prompt, chat)
        context = self.runner.context_length
        n = encoded.input_ids.numel()
        if context is not None and n >= context:
            raise ValueError(f"prompt is {n} tokens long, but the model's context is {context} tokens")
        if context is not None and n + max_new_tokens > context:
            raise ValueError(f"max_new_tokens={max_new_tokens} with a {n}-token prompt exceeds the model's "
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
            verifier = build_verifier(self.verifier, request.sampling)
            stats = speculative_decode(self.runner, self.drafter, verifier, request.prompt, request.sampling,
                                       stopper, generator)
        else:
            stats = plain_decode(self.runner, request.prompt, request.sampling, stopper, generator)
        seconds = time.perf_counter() - start
        return GenerationResult(token_ids=list(stopper.tokens), text=stopper.text(),
                                finish_reason=stopper.finish_reason or "length", seconds=seconds, stats=stats)


def build_drafter(name: str, target: LoadedModel, draft: LoadedModel | None = None,
                  num_draft_tokens: int | None = None, adaptive: bool = False) -> Drafter | None:
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; expected one of: {', '.join(DRAFTERS)}")
    if name == "none":
        return None
    k = DEFAULT_NUM_DRAFT_TOKENS[name] if num_draft_tokens is None else num_draft_tokens
    if name == "prompt-lookup":
        return PromptLookupDrafter(num_draft_tokens=k)
    if draft is None:
        raise ValueError("drafter 'draft-model' needs a draft model (--draft / draft=)")
    return DraftModelDrafter(CachedModel(draft.model), CachedModel(target.model).vocab_size,
                             num_draft_tokens=k, adaptive=adaptive)


def load(target: str | LoadedModel = "qwen2.5-coder-1.5b", *, drafter: str = "draft-model",
         draft: str | LoadedModel | None = "qwen2.5-coder-0.5b", num_draft_tokens: int | None = None,
         adaptive: bool = False, verifier: str = "auto", dtype: str = "bfloat16", device: str | None = None,
         progress: bool = True) -> Pipeline:
    """Load a target (and, for the draft-model drafter, a draft) and build a Pipeline."""
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; expected one of: {', '.join(DRAFTERS)}")
    if num_draft_tokens is not None and (isinstance(num_draft_tokens, bool) or num_draft_tokens < 1):
        raise ValueError(f"k (num_draft_tokens) must be an integer >= 1, got {num_draft_tokens!r}")
    if isinstance(target, str):
        target = load_model(target, dtype=dtype, device=device, progress=progress)
    if drafter == "draft-model" and isinstance(draft, str):
        draft = load_model(draft, dtype=dtype, device=device, progress=progress)
    return Pipeline(target, build_drafter(drafter, target, draft if drafter == "draft-model" else None,
                                          num_draft_tokens, adaptive), verifier)


__all__ = ["Pipeline", "Request", "load", "build_drafter", "GenerationStats"]
