"""vLLM's `speculative_config` (JSON on the command line, a dict in Python) mapped onto sparrow's drafter options.

The one place the mapping lives; `sparrow generate/serve/bench --speculative-config JSON`, `sparrow.load(...,
speculative_config=)` and `sparrow.generate(..., speculative_config=)` all go through `apply`, called by
`sparrow.drafters.plan.with_speculative_config` (the plan's resolver).

    key                                   sparrow
    method: ngram                         --drafter prompt-lookup
    method: draft_model                   --drafter draft-model
    method: eagle | eagle3                --drafter eagle
    method: suffix                        --drafter suffix
    model                                 --draft (draft_model), --head (eagle, eagle3)
    num_speculative_tokens                -k / num_draft_tokens
    prompt_lookup_max / prompt_lookup_min prompt lookup's longest / shortest n-gram (max_n / min_n)
    suffix_decoding_max_tree_depth        suffix option max_tree_depth (and the same for the three below)
    suffix_decoding_max_cached_requests   max_cached_requests
    suffix_decoding_max_spec_factor       max_spec_factor
    suffix_decoding_min_token_prob        min_token_prob

Without `method`, a `model` means draft_model and prompt_lookup_* mean ngram (vLLM's inference). Other methods
(mtp, medusa, mlp_speculator, ...) and other keys are refused, naming them; so is a key that does not apply to
the method, and a key that contradicts a flag or argument given beside it (naming both).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparrow.errors import UserError

METHODS = {"ngram": "prompt-lookup", "draft_model": "draft-model", "eagle": "eagle", "eagle3": "eagle",
           "suffix": "suffix"}
REFUSED_METHODS = {
    "mtp": "no supported model ships multi-token-prediction heads",
    "deepseek_mtp": "no supported model ships multi-token-prediction heads",
    "medusa": "Medusa heads are not implemented (use eagle)",
    "mlp_speculator": "MLP speculators are not implemented (use eagle)",
}
SUFFIX_KEYS = {"suffix_decoding_max_tree_depth": "max_tree_depth",
               "suffix_decoding_max_cached_requests": "max_cached_requests",
               "suffix_decoding_max_spec_factor": "max_spec_factor",
               "suffix_decoding_min_token_prob": "min_token_prob"}
KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", *SUFFIX_KEYS)


@dataclass(frozen=True)
class SpeculativeChoice:
    """What a speculative config asks for, in sparrow's terms (None: the config leaves it alone)."""

    drafter: str
    num_draft_tokens: int | None = None
    draft: str | None = None  # the draft model (draft-model)
    options: dict[str, Any] = field(default_factory=dict)  # drafter options (head, min_n/max_n, suffix's)


def parse(text: str, flag: str = "--speculative-config") -> dict[str, Any]:
    """The JSON object given on the command line (one-line error for anything else)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{flag} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(value, dict):
        raise UserError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def _int(config: Mapping[str, Any], key: str, low: int) -> int | None:
    value = config.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise UserError(f"speculative config key {key!r} must be an integer >= {low}, got {value!r}")
    return value


def resolve(config: Mapping[str, Any] | str) -> SpeculativeChoice:
    """The choice a config (a dict, or its JSON text) makes; every key checked."""
    if isinstance(config, str):
        config = parse(config, "speculative_config")
    if not isinstance(config, Mapping):
        raise UserError(f"speculative_config must be a dict or a JSON string, got {type(config).__name__}")
    for key in config:
        if key not in KEYS:
            raise UserError(f"speculative config key {key!r} is not supported by sparrow; supported keys: "
                            f"{', '.join(KEYS)}")
    method = config.get("method")
    if method is None:
        method = ("draft_model" if config.get("model") is not None else
                  "ngram" if "prompt_lookup_max" in config or "prompt_lookup_min" in config else None)
        if method is None:
            raise UserError(f"speculative config needs 'method' (one of: {', '.join(METHODS)})")
    if method in REFUSED_METHODS:
        raise UserError(f"speculative config method {method!r} is not supported by sparrow: "
                        f"{REFUSED_METHODS[method]}; supported: {', '.join(METHODS)}")
    if method not in METHODS:
        raise UserError(f"unknown speculative config method {method!r}; supported: {', '.join(METHODS)}")
    applies = {"model": ("draft_model", "eagle", "eagle3"), "prompt_lookup_max": ("ngram",),
               "prompt_lookup_min": ("ngram",), **{key: ("suffix",) for key in SUFFIX_KEYS}}
    for key, methods in applies.items():
        if key in config and method not in methods:
            raise UserError(f"speculative config key {key!r} does not apply to method {method!r}")
    model = config.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise UserError(f"speculative config key 'model' must be a model name or path, got {model!r}")
    options: dict[str, Any] = {}
    if method in ("eagle", "eagle3") and model is not None:
        options["head"] = model
    for key, name in (("prompt_lookup_max", "max_n"), ("prompt_lookup_min", "min_n")):
        if _int(config, key, 1) is not None:
            options[name] = config[key]
    for key, name in SUFFIX_KEYS.items():
        if key in config:
            options[name] = config[key]  # SuffixConfig checks the values
    return SpeculativeChoice(METHODS[method], _int(config, "num_speculative_tokens", 1),
                             model if method == "draft_model" else None, options)


FLAG_NAMES = {"drafter": "--drafter", "draft": "--draft", "num_draft_tokens": "-k/--num-draft-tokens",
              "head": "--head"}
KEY_NAMES = {"drafter": "method", "draft": "model", "num_draft_tokens": "num_speculative_tokens", "head": "model",
             "max_n": "prompt_lookup_max", "min_n": "prompt_lookup_min", **{v: k for k, v in SUFFIX_KEYS.items()}}


def apply(config: Mapping[str, Any] | str | None, given: Mapping[str, Any], *,
          python: bool = False) -> tuple[str | None, str | None, int | None, dict[str, Any]]:
    """(drafter, draft, num_draft_tokens, drafter options) from a config and what was given beside it.

    given: the flags / arguments the caller set explicitly (keys drafter, draft, num_draft_tokens and drafter
    option names) with their values; a config key that contradicts one is refused naming both. The values
    returned are the config's where it sets them, else None (the caller keeps its own); options are merged.
    python: name arguments (`drafter=`) rather than flags (`--drafter`) in errors."""
    if config is None:
        return None, None, None, {}
    choice = resolve(config)
    mine = {"drafter": choice.drafter, "draft": choice.draft, "num_draft_tokens": choice.num_draft_tokens,
            **choice.options}
    for name, value in mine.items():
        if value is None or name not in given or given[name] is None or given[name] == value:
            continue
        flag = f"{name}=" if python else FLAG_NAMES.get(name, f"--{name.replace('_', '-')}")
        key = KEY_NAMES.get(name, name)
        raise UserError(f"{flag} {given[name]!r} contradicts speculative config key {key!r} ({value!r}); "
                        "give one of them")
    return choice.drafter, choice.draft, choice.num_draft_tokens, dict(choice.options)


def merged(config: Mapping[str, Any] | str | None, *, drafter: str, draft: Any, num_draft_tokens: int | None,
           options: Mapping[str, Any], given: set[str] | frozenset[str],
           python: bool = False) -> tuple[str, Any, int | None, dict[str, Any]]:
    """(drafter, draft, num_draft_tokens, options) with `config` applied over them; `given`: which of them (and
    of the option names) the caller set explicitly (a contradiction with the config is refused)."""
    if config is None:
        return drafter, draft, num_draft_tokens, dict(options)
    values = {"drafter": drafter, "draft": draft, "num_draft_tokens": num_draft_tokens, **options}
    chosen, model, k, extra = apply(config, {n: v for n, v in values.items() if n in given}, python=python)
    return (chosen, model if model is not None else draft, k if k is not None else num_draft_tokens,
            {**options, **extra})


def given_arguments(drafter: str, draft: Any, num_draft_tokens: int | None,
                    options: Mapping[str, Any]) -> frozenset[str]:
    """The Python API's arguments that differ from `sparrow.load`'s defaults, and every option (an argument left
    at its default gives way to the config)."""
    given = {name for name, value, default in (("drafter", drafter, "draft-model"), ("draft", draft, "default"),
                                                  ("num_draft_tokens", num_draft_tokens, None)) if value != default}
    return frozenset(given | set(options))
