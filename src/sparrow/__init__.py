"""sparrow: lossless speculative decoding for LLMs and Video-LLMs."""

from sparrow.config import GREEDY, SamplingConfig, StoppingConfig
from sparrow.pipeline import Pipeline, load
from sparrow.types import Draft, GenerationResult, GenerationStats, Prompt, Verdict

_PIPELINES: dict[tuple, Pipeline] = {}


def generate(prompt, *, target: str = "qwen2.5-coder-1.5b", drafter: str = "draft-model",
             draft: str | None = "default", num_draft_tokens: int | None = None,
             adaptive: bool = True, dtype: str = "bfloat16", device: str | None = None,
             quant: str | None = None, draft_quant: str | None = None, **options) -> GenerationResult:
    """One-call API: loads (and caches) the pipeline, then generates speculatively.

    quant / draft_quant: "int8" | "int4" weight-only target / draft (see sparrow.load).
    options: max_new_tokens, temperature, top_k, top_p, seed, stop, chat.
    """
    key = (target, drafter, draft, num_draft_tokens, adaptive, dtype, device, quant, draft_quant)
    if key not in _PIPELINES:
        _PIPELINES[key] = load(target, drafter=drafter, draft=draft, num_draft_tokens=num_draft_tokens,
                               adaptive=adaptive, dtype=dtype, device=device, quant=quant, draft_quant=draft_quant)
    return _PIPELINES[key].generate(prompt, **options)


__all__ = ["generate", "load", "Pipeline", "SamplingConfig", "StoppingConfig", "GREEDY", "Draft", "Verdict",
           "Prompt", "GenerationResult", "GenerationStats"]
