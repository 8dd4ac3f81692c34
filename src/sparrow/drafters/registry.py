"""Drafters by name: `REGISTRY` maps a name to a `DrafterEntry`, read at call time.

Builders are callables, or "module:function" strings (as vLLM names custom proposers) imported on
first use, so this module imports no drafter implementation. A drafter added later,

    REGISTRY["mine"] = DrafterEntry(build_mine, default_num_draft_tokens=8)

is accepted by `sparrow.load(drafter="mine")`, `build_drafter`, the CLI and `sparrow bench`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparrow.drafters.base import Drafter
from sparrow.errors import UserError
from sparrow.models.quantization import AUTO, GGUF, parse_quant

if TYPE_CHECKING:
    from sparrow.models import LoadedModel

NONE = "none"  # plain decoding, no drafter
POSITIONAL = ("target", "draft", "num_draft_tokens", "adaptive")  # what every builder receives first


def _resolve(ref: Any) -> Any:
    """A callable or class given itself or as "module:attribute"."""
    if not isinstance(ref, str):
        return ref
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class DrafterEntry:
    """How to build a drafter by name; `build(target, draft, num_draft_tokens, adaptive, **options)`."""

    build: Callable[..., Drafter] | str  # the builder, or "module:function" imported on first use
    default_num_draft_tokens: int | None  # None: the builder picks (layer-skip: the k its set was tuned for)
    needs_draft_model: bool = False
    uses_draft_model: bool = False  # optional: used when one is given ("auto")
    default_draft: str | None = None  # the draft model `sparrow.load(draft="default")` picks
    config: type | str | None = None  # for a builder taking **options: the dataclass whose fields they are
    compiles: bool = True  # runs on a compiled target (static KV cache); False: compile=True is refused up front
    compiles_draft: bool = False  # compile=True compiles its own model too (its draft model, or quantized copy)
    quantized_copy: bool = False  # drafts with a quantized copy of the target, in the format --draft-quant names
    dense_target: str | None = None  # why it needs an unquantized target (--quant is refused); None: any target

    @property
    def takes_draft_model(self) -> bool:
        """The builder receives the draft model (it needs one, or uses one when given)."""
        return self.needs_draft_model or self.uses_draft_model

    @property
    def drafts_with_model(self) -> bool:
        """It runs a model of its own to draft (a draft model, or the quantized copy), so --draft-quant applies."""
        return self.takes_draft_model or self.quantized_copy

    @property
    def builder(self) -> Callable[..., Drafter]:
        return _resolve(self.build)

    def options(self) -> tuple[str, ...] | None:
        """The keyword options the builder accepts (None: any, it takes **options without a config)."""
        if self.config is not None:
            return tuple(f.name for f in dataclasses.fields(_resolve(self.config)) if f.name not in POSITIONAL)
        parameters = list(inspect.signature(self.builder).parameters.values())[len(POSITIONAL):]
        if any(p.kind is p.VAR_KEYWORD for p in parameters):
            return None
        return tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


REGISTRY: dict[str, DrafterEntry] = {
    "draft-model": DrafterEntry(
        "sparrow.drafters.draft_model:build",
        default_num_draft_tokens=8,
        needs_draft_model=True,
        default_draft="qwen2.5-coder-0.5b",
        compiles_draft=True,
    ),
    "prompt-lookup": DrafterEntry("sparrow.drafters.prompt_lookup:build", default_num_draft_tokens=16),
    "suffix": DrafterEntry("sparrow.drafters.suffix:build", default_num_draft_tokens=None),  # max_tree_depth
    "quantized-self": DrafterEntry(
        "sparrow.drafters.quantized_self:build_quantized_self", default_num_draft_tokens=8, quantized_copy=True,
        compiles_draft=True,
        dense_target="it drafts with a quantized copy of it; drop --quant, or use --drafter draft-model with "
                     "--draft-quant"),
    "cross-vocab": DrafterEntry(
        "sparrow.drafters.cross_vocab:build",
        default_num_draft_tokens=8,
        needs_draft_model=True,
        default_draft="qwen2.5-coder-0.5b",
        config="sparrow.drafters.cross_vocab:CrossVocabConfig",
    ),
    "auto": DrafterEntry(
        "sparrow.drafters.auto:build",
        default_num_draft_tokens=16,
        uses_draft_model=True,
        default_draft="qwen2.5-coder-0.5b",
        compiles_draft=True,  # its draft-model candidate's, when it has a draft model
    ),
    "sparse": DrafterEntry("sparrow.drafters.sparse:build", default_num_draft_tokens=8, compiles=False),
    "visual-prune": DrafterEntry(
        "sparrow.drafters.visual_prune:build", default_num_draft_tokens=8, uses_draft_model=True, compiles=False
    ),  # sparse and visual-prune read the target's prefill queries, which a static cache's prefill never records
    "layer-skip": DrafterEntry(
        "sparrow.drafters.layer_skip:build_layer_skip", default_num_draft_tokens=None, compiles=False,
        dense_target="its skip sets are tuned on the dense model; drop --quant",
    ),  # drafts in the target's own cache, which it crops per layer
    "eagle": DrafterEntry("sparrow.drafters.eagle:build", default_num_draft_tokens=6),  # option head=PATH
}


@dataclass(frozen=True)
class OptionRule:
    """A generation option beside the drafter's name, declared once: what `sparrow.load` receives for it (a
    small example value, used by tests/test_matrix.py to run every drafter x option) and which drafters it
    applies to. A drafter whose builder accepts `drafter_option` takes it; `needs_draft`: drafters running a
    draft model (or a quantized copy of the target); `dense_target`: not for drafters that need an unquantized
    target. Anything else is refused before a model loads."""

    name: str
    load_options: Mapping[str, Any]  # keyword arguments of sparrow.load
    drafter_option: str | None = None
    needs_draft: bool = False
    dense_target: bool = False  # it quantizes the target
    lossy: bool = False  # the output may differ from the target's (checked to run, not to be exact)

    def applies(self, drafter: str) -> bool:
        if drafter == NONE:
            return False
        entry = REGISTRY[drafter]
        if self.dense_target and entry.dense_target is not None:
            return False
        if self.load_options.get("compile") and not entry.compiles:
            return False
        if self.needs_draft and not entry.drafts_with_model:
            return False
        if self.drafter_option is not None:
            accepted = entry.options()
            return accepted is None or self.drafter_option in accepted
        return True


OPTION_RULES: tuple[OptionRule, ...] = (
    OptionRule("tree", {"tree_budget": 4, "tree_topk": 2, "tree_depth": 3}, drafter_option="tree_budget"),
    OptionRule("draft-vocab", {"draft_vocab": 64}, drafter_option="draft_vocab"),
    OptionRule("draft-kv", {"draft_kv": "topk", "draft_kv_budget": 8}, drafter_option="draft_kv"),
    OptionRule("quantized-draft", {"draft_quant": "int8"}, needs_draft=True),
    OptionRule("quantized-target", {"quant": "int8"}, dense_target=True),
    OptionRule("compile", {"compile": True}),  # not for drafters registered with compiles=False
    OptionRule("loose", {"verifier": "loose"}, lossy=True),
)
"""Every option the CLI and `sparrow.load` take beside the drafter, for the option matrix (tests/test_matrix.py):
a new option joins the matrix by being declared here, a new drafter by being registered."""


def drafter_names() -> tuple[str, ...]:
    """Every registered drafter, now, and "none" (plain decoding)."""
    return (*REGISTRY, NONE)


def check_compile(name: str, compile: bool) -> None:
    """Refuse compile=True for a drafter registered with compiles=False (before any model is loaded)."""
    if compile and name in REGISTRY and not REGISTRY[name].compiles:
        raise UserError(f"drafter {name!r} does not run on a compiled target (--compile: a static KV cache); "
                         "drop --compile or pick another drafter")


def check_drafter_args(name: str, num_draft_tokens: int | None, options: Mapping[str, Any] | None = None) -> None:
    """Cheap validation, run before any model is loaded: the name, k, and the option names."""
    if name not in drafter_names():
        raise UserError(f"unknown drafter {name!r}; expected one of: {', '.join(drafter_names())}")
    if num_draft_tokens is not None and (isinstance(num_draft_tokens, bool) or num_draft_tokens < 1):
        raise UserError(f"k (num_draft_tokens) must be an integer >= 1, got {num_draft_tokens!r}")
    accepted = () if name == NONE else REGISTRY[name].options()
    unknown = [option for option in options or () if accepted is not None and option not in accepted]
    if unknown:
        raise UserError(f"drafter {name!r} does not accept option {', '.join(map(repr, unknown))}; "
                         f"its options: {', '.join(accepted) or 'none'}")


def takers(option: str) -> tuple[str, ...]:
    """The registered drafters whose builder takes `option`."""
    return tuple(name for name, entry in REGISTRY.items() if option in (entry.options() or ()))


def check_applies(name: str, flag: str, option: str) -> None:
    """Refuse `flag` (the CLI's spelling of the drafter option `option`) for drafter `name` if it does not take it,
    naming the drafters that do (before any model is loaded)."""
    accepted = () if name == NONE or name not in REGISTRY else REGISTRY[name].options()
    if accepted is not None and option not in accepted:
        names = takers(option)
        listed = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)
        raise UserError(f"{flag} applies to --drafter {listed} only, not {name!r}")


def check_quant_args(name: str, quant: str | None, draft_quant: str | None, has_draft_model: bool) -> None:
    """Cheap validation of --quant / --draft-quant for drafter `name`, run before any model is loaded."""
    quant = parse_quant(quant, "quant", auto=True)
    parse_quant(draft_quant, "draft_quant", auto=True)
    entry = REGISTRY.get(name)  # None: "none"
    quantized_copy = entry is not None and entry.quantized_copy
    if entry is not None and entry.dense_target is not None and quant is not None \
            and not (quant == AUTO and quantized_copy):  # auto: the dense target its copy needs
        raise UserError(f"drafter {name!r} needs an unquantized target ({entry.dense_target})")
    if draft_quant is not None and not has_draft_model and not quantized_copy:
        raise UserError(f"draft_quant needs a draft model, and drafter {name!r} has none")
    if parse_quant(draft_quant, "draft_quant", auto=True) == GGUF and quantized_copy:
        raise UserError(f"draft_quant='gguf' loads a draft model from its GGUF file; drafter {name!r} drafts with a "
                        "quantized copy of the target instead (int8, int4 or w8a8)")


def build_drafter(name: str, target: LoadedModel, draft: LoadedModel | None = None,
                  num_draft_tokens: int | None = None, adaptive: bool = False, **options: Any) -> Drafter | None:
    """The drafter registered as `name` (None for "none")."""
    check_drafter_args(name, num_draft_tokens, options)
    if name == NONE:
        return None
    entry = REGISTRY[name]
    if entry.needs_draft_model and draft is None:
        raise UserError(f"drafter {name!r} needs a draft model (--draft / draft=)")
    k = entry.default_num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    return entry.builder(target, draft if entry.takes_draft_model else None, k, adaptive, **options)
