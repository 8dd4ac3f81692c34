"""Method names of `sparrow bench`, their baselines and the models they need.

sparrow methods: "plain" (sparrow's own plain decoding) and every registered drafter name.
Peers (transformers `generate` in the same process): "hf-plain", "hf-assisted" (draft model),
"hf-prompt-lookup", "hf-uad" (assistant with another tokenizer, universal assisted decoding).
Each method is measured against its own plain baseline: sparrow methods against "plain",
peers against "hf-plain".
"""

from __future__ import annotations

from collections.abc import Sequence

from sparrow.drafters.registry import REGISTRY
from sparrow.errors import UserError

PLAIN = "plain"
HF_PLAIN = "hf-plain"
PEERS = (HF_PLAIN, "hf-assisted", "hf-prompt-lookup", "hf-uad")
CROSS_VOCAB = ("cross-vocab", "hf-uad")  # drafted by the other-tokenizer model (--cross-draft)


def sparrow_methods() -> tuple[str, ...]:
    return (PLAIN, *REGISTRY)  # read at call time: drafters registered later count too


def known_methods() -> tuple[str, ...]:
    return (*sparrow_methods(), *PEERS)


def is_peer(method: str) -> bool:
    return method.startswith("hf-")


def baseline_of(method: str) -> str:
    return HF_PLAIN if is_peer(method) else PLAIN


def needs_draft(method: str) -> bool:
    """Needs (or uses, like "auto") the same-vocabulary draft model (--draft)."""
    if method in CROSS_VOCAB:
        return False
    entry = REGISTRY.get(method)
    return method == "hf-assisted" or (entry is not None and entry.takes_draft_model)


def needs_same_vocabulary(method: str) -> bool:
    """Cannot run unless the --draft model has the target's vocabulary ("auto" switches to cross-vocab itself)."""
    entry = REGISTRY.get(method)
    return method == "hf-assisted" or (entry is not None and entry.needs_draft_model and method not in CROSS_VOCAB)


def needs_cross_draft(method: str) -> bool:
    """Needs the draft model with another tokenizer (--cross-draft)."""
    return method in CROSS_VOCAB


def parse_methods(methods: str | Sequence[str]) -> list[str]:
    """Validated method list, in the given order, each baseline added in front when missing."""
    names = [m.strip() for m in methods.split(",")] if isinstance(methods, str) else [m.strip() for m in methods]
    names = [m for m in names if m]
    if not names:
        raise UserError("methods must name at least one method")
    known = known_methods()
    unknown = [m for m in names if m not in known]
    if unknown:
        raise UserError(f"unknown methods {', '.join(map(repr, unknown))}; expected any of: {', '.join(known)}")
    chosen = list(dict.fromkeys(names))
    for base in (HF_PLAIN, PLAIN):
        if any(baseline_of(m) == base for m in chosen) and base not in chosen:
            chosen.insert(0, base)
    bases = [m for m in chosen if m in (PLAIN, HF_PLAIN)]
    return bases + [m for m in chosen if m not in bases]  # baselines first: later rows compare against them
