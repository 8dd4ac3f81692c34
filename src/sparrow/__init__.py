"""sparrow: lossless speculative decoding for LLMs and Video-LLMs.

The names below are imported on first use (PEP 562), so `import sparrow.heads...` on a bare machine (torch,
transformers, safetensors, numpy: the GPU head recipe, `sparrow.training.recipe`) does not pull in the CLI's and the
loader's dependencies."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparrow.config import GREEDY, SamplingConfig, StoppingConfig
    from sparrow.drafters.plan import SpecPlan, resolve_plan
    from sparrow.engine import Engine
    from sparrow.loading import PipelineCache, load
    from sparrow.pipeline import Pipeline
    from sparrow.types import Draft, GenerationResult, GenerationStats, Prompt, Verdict

    PIPELINES: PipelineCache

_LAZY = {
    **dict.fromkeys(("GREEDY", "SamplingConfig", "StoppingConfig"), "sparrow.config"),
    **dict.fromkeys(("PipelineCache", "load"), "sparrow.loading"),
    **dict.fromkeys(("SpecPlan", "resolve_plan"), "sparrow.drafters.plan"),
    "Pipeline": "sparrow.pipeline",
    "Engine": "sparrow.engine",
    **dict.fromkeys(("Draft", "GenerationResult", "GenerationStats", "Prompt", "Verdict"), "sparrow.types"),
}


def __getattr__(name: str) -> Any:
    if name == "PIPELINES":
        # What `generate` keeps: the 4 most recently used pipelines and the models they run (shared between them).
        # `sparrow.PIPELINES.clear()` frees them.
        from sparrow.loading import PipelineCache  # lazily, as every name here (see the module docstring)

        return globals().setdefault("PIPELINES", PipelineCache(size=4))
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sparrow' has no attribute {name!r}")


def generate(prompt, *, target: str = "qwen2.5-coder-1.5b", drafter: str = "draft-model",
             draft: str | None = "default", num_draft_tokens: int | None = None,
             adaptive: bool = True, dtype: str = "auto", device: str | None = None,
             quant: str | None = None, draft_quant: str | None = None, speculative_config=None,
             exact: bool | None = None, **options) -> GenerationResult:
    """One-call API: gets a pipeline from `PIPELINES` (loading its models once), then generates speculatively.

    Safe to call from several threads: generations on the same models run one at a time (see sparrow.pipeline).
    quant / draft_quant: "int8" | "int4" weight-only target / draft (see sparrow.load).
    speculative_config: vLLM's speculative config, a dict or JSON text (see sparrow.load).
    exact: batch-invariant verification, greedy output equal to plain decoding in any dtype (see sparrow.load;
    None: on for a quantized target).
    options: max_new_tokens, temperature, top_k, top_p, seed, stop, chat.
    """
    pipelines = globals()["PIPELINES"] if "PIPELINES" in globals() else __getattr__("PIPELINES")
    pipe = pipelines.get(target, drafter=drafter, draft=draft, num_draft_tokens=num_draft_tokens, adaptive=adaptive,
                         dtype=dtype, device=device, quant=quant, draft_quant=draft_quant,
                         speculative_config=speculative_config, exact=exact)
    return pipe.generate(prompt, **options)


__all__ = ["generate", "load", "resolve_plan", "SpecPlan", "Pipeline", "Engine", "PipelineCache", "PIPELINES",
           "SamplingConfig", "StoppingConfig", "GREEDY", "Draft", "Verdict", "Prompt", "GenerationResult",
           "GenerationStats"]
