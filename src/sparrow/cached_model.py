"""CachedModel: a Hugging Face causal LM together with the KV cache it owns.

The same wrapper serves as the target (prefill, score, rewind) and inside model-backed
drafters, so plain decoding, drafting and verification all run the model the same way.

Cache invariant between engine rounds: the cache holds KV for committed[:-1]; the newest
committed token is the first input of the next forward. Positions are never assumed to be
1-D: `position_ids` is a hook (None lets the model derive them, which also covers models
with their own position scheme, e.g. Qwen2.5-VL's 3-D M-RoPE with rope deltas).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from sparrow.types import Prompt


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class CachedModel:
    def __new__(cls, model: PreTrainedModel | None = None, *args, **kwargs):  # None: copy/pickle
        """Factory: `CachedModel(vlm)` returns the subclass that runs the model's own visual prefill and
        position scheme (sparrow.vision.cached, e.g. Qwen2.5-VL's M-RoPE); subclasses are built as asked."""
        if cls is CachedModel and model is not None:
            from sparrow.vision.cached import cached_model_class

            cls = cached_model_class(model)
        return super().__new__(cls)

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = _text_config(model.config)
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None

    @property
    def vocab_size(self) -> int:
        """Width of the logits (may exceed the tokenizer's real vocabulary because of padding)."""
        head = self.model.get_output_embeddings()
        return head.weight.shape[0] if head is not None else self.config.vocab_size

    @property
    def context_length(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def length(self) -> int:
        """Number of positions whose KV the cache holds."""
        return self.cache.get_seq_length() if self.cache is not None else 0

    def position_ids(self, start: int, num_tokens: int) -> Tensor | None:
        """Position ids for tokens at cache positions [start, start + n); None lets the model decide."""
        return None

    @torch.inference_mode()
    def prefill(self, prompt: Prompt) -> Tensor:
        """Reset the cache and run the prompt. Returns [vocab] logits for the first new token."""
        self.cache = DynamicCache(config=self.model.config)
        # Sliding-window layers (Gemma-3) drop states beyond the window unless they record the past, and
        # then could not be rewound once the window is full; rewind() trims them back to the window.
        self.cache.activate_past_recording()
        out = self.model(
            input_ids=prompt.input_ids.to(self.device)[None],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
            **prompt.model_inputs,
        )
        self.cache.crop(0)  # sliding-window layers back to their window (a no-op for full-attention layers)
        return out.logits[0, -1]

    @torch.inference_mode()
    def forward(self, tokens: Tensor) -> Tensor:
        """Append `tokens` ([n] int64) after the cached positions. Returns [n, vocab] logits."""
        assert tokens.ndim == 1 and tokens.numel() > 0, tuple(tokens.shape)
        assert self.cache is not None, "prefill() must run before forward()"
        start = self.length
        out = self.model(
            input_ids=tokens.to(self.device)[None],
            past_key_values=self.cache,
            use_cache=True,
            position_ids=self.position_ids(start, tokens.numel()),
        )
        return out.logits[0]

    def rewind(self, length: int) -> None:
        """Drop cached positions >= length."""
        assert self.cache is not None
        surplus = self.length - length
        assert surplus >= 0, f"cannot rewind a cache of length {self.length} forward to {length}"
        self.cache.crop(-surplus)  # transformers >= 5: negative = positions to drop; 0 trims sliding layers
