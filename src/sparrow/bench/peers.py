"""Peers: transformers' own `generate` (plain greedy, assisted with a draft model, prompt lookup,
universal assisted decoding with another tokenizer), timed the same way as sparrow's methods."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from sparrow.errors import UserError
from sparrow.models import LoadedModel
from sparrow.timing import now


def hf_generate(target: LoadedModel, ids: Tensor, max_new_tokens: int, **peer_options) -> list[int]:
    """transformers' own greedy `generate` on the prompt ids ([n]); `peer_options` pick the peer mode
    (assistant_model=..., prompt_lookup_num_tokens=..., tokenizer/assistant_tokenizer=...). New tokens only."""
    options = dict(max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                   pad_token_id=target.tokenizer.pad_token_id or target.tokenizer.eos_token_id, **peer_options)
    with torch.inference_mode():
        out = target.model.generate(ids[None].to(target.model.device), attention_mask=torch.ones_like(ids)[None],
                                    **options)
    return out[0, ids.numel():].tolist()


@contextlib.contextmanager
def count_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """Counts top-level forwards of `model` inside the block (yields a one-element list)."""
    calls = [0]

    def hook(module, args) -> None:
        calls[0] += 1

    handle = model.register_forward_pre_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


def peer_options(method: str, draft: LoadedModel | None, cross_draft: LoadedModel | None, target: LoadedModel,
                 lookup_tokens: int) -> dict:
    """generate() keyword arguments of a peer method."""
    if method == "hf-plain":
        return {}
    if method == "hf-assisted":
        assert draft is not None, "hf-assisted needs a draft model"
        return {"assistant_model": draft.model}
    if method == "hf-prompt-lookup":
        return {"prompt_lookup_num_tokens": lookup_tokens}
    if method == "hf-uad":
        assert cross_draft is not None, "hf-uad needs a draft model with another tokenizer"
        return {"assistant_model": cross_draft.model, "tokenizer": target.tokenizer,
                "assistant_tokenizer": cross_draft.tokenizer}
    raise UserError(f"unknown peer method {method!r}")


@dataclass(frozen=True)
class PeerRun:
    token_ids: list[int]
    seconds: float
    target_forwards: int  # top-level target forwards, the prompt's included


def run_peer(method: str, target: LoadedModel, ids: Tensor, max_new_tokens: int, draft: LoadedModel | None,
             cross_draft: LoadedModel | None, lookup_tokens: int = 10) -> PeerRun:
    options = peer_options(method, draft, cross_draft, target, lookup_tokens)
    device = target.model.device
    with count_forwards(target.model) as calls:
        start = now(device)
        tokens = hf_generate(target, ids, max_new_tokens, **options)
        seconds = now(device) - start
    return PeerRun(tokens, seconds, calls[0])
