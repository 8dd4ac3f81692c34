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
from transformers.cache_utils import DynamicSlidingWindowLayer

from sparrow.runtime import decoder
from sparrow.runtime.kv_buffer import buffered
from sparrow.runtime.prefix_cache import PrefixCache
from sparrow.types import Prompt, TargetOutput


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


PREFILL_MODULE = "sparrow_prefill"
"""A model's attribute (in its __dict__) naming another module that runs its prompt prefills over the same KV cache:
a quantized target's dense source model (`sparrow.models.quantization.PREFILL`)."""


def prefill_module(model: PreTrainedModel) -> PreTrainedModel:
    """The module that runs `model`'s prompt prefills: its PREFILL_MODULE, or `model` itself."""
    return model.__dict__.get(PREFILL_MODULE, model)


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """[..] bool (True = may attend) -> the additive float mask transformers' sdpa and eager attention take."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


class CachedModel:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = _text_config(model.config)
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self.position_offset = 0
        """Model position = cache index + position_offset for tokens fed after the prefill. 0 unless a drafter
        removed prompt entries from this cache whose positions later tokens must keep (drafters/draft_kv.py)."""
        self.prefix_cache: PrefixCache | None = None
        """Earlier sequences' caches to prefill from (`sparrow.runtime.prefix_cache`; None: every prefill is whole)."""
        self.held: list[int] = []
        """Token ids whose KV the cache holds at positions 0.. (the prompt after a prefill; `hold` extends it)."""
        self.reused = 0
        """Prompt tokens the last prefill took from the prefix cache."""
        self.decoder = decoder.plan(model)
        """The forward of steps and verifies without transformers' plumbing, where it computes the model's own
        (`sparrow.runtime.decoder`: Llama / Qwen2 of their own modules, no hooks); None: the model's forward."""

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

    def position_ids(self, positions: Tensor) -> Tensor:
        """The model's `position_ids` for tokens at cache-index positions `positions` ([n] int64)."""
        return (positions.to(self.device) + self.position_offset)[None]

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """Reset the cache and run the prompt. Returns the logits of the last prompt row ([1, vocab]) and,
        when asked for, the hidden states of every prompt row ([len(hidden_layers), n, d])."""
        ids = prompt.input_ids.tolist() if self.prefix_cache is not None else []  # `held`: for the prefix cache only
        taken = self._take(ids) if self._reusable(prompt, hidden_layers) else None
        if taken is None:
            self.clear()
            start = 0
        else:
            self.cache, start = taken
            self.position_offset = 0
        out = prefill_module(self.model)(
            input_ids=prompt.input_ids[start:].to(self.device)[None],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states=bool(hidden_layers),
            **prompt.model_inputs,
        )
        self.cache.crop(0)  # sliding-window layers back to their window (a no-op for full-attention layers)
        self.held, self.reused = ids, start
        return self._output(out, hidden_layers)

    def _reusable(self, prompt: Prompt, hidden_layers: tuple[int, ...]) -> bool:
        """Whether this prefill may start from a kept prefix: a text prompt whose rows' hidden states nobody asked
        for, on a model without sliding-window layers (their caches cannot be cropped back into the window)."""
        layer_types = getattr(self.config, "layer_types", None) or []
        return (self.prefix_cache is not None and not hidden_layers and not prompt.model_inputs
                and "sliding_attention" not in layer_types)

    def cached_prefix(self, prompt: Prompt, hidden_layers: tuple[int, ...] = ()) -> int:
        """The prompt positions a prefill of `prompt` would take from the prefix cache (0: none, or no cache)."""
        if not self._reusable(prompt, hidden_layers):
            return 0
        return self.prefix_cache.shared(prompt.input_ids.tolist())

    def _take(self, ids: list[int]) -> tuple[DynamicCache, int] | None:
        """Park the current cache in the prefix cache; take the best one for `ids`."""
        self.park()
        return self.prefix_cache.take(ids, self._empty)

    def park(self) -> None:
        """Hand the cache (what `held` says it holds, cut to that) to the prefix cache, if there is one; the runner
        is left without a cache."""
        if self.prefix_cache is not None and self.cache is not None and self.position_offset == 0:
            held = self.held[:self.length]
            self.rewind(len(held))
            self.prefix_cache.park(held, self.cache)
        self.cache, self.held = None, []

    def hold(self, prompt: Tensor, output: list[int]) -> None:
        """A generation of `output` after `prompt` finished: the cache holds the KV of its committed tokens but the
        last, as far as its length goes, which the next prefill parks in the prefix cache (a no-op without one)."""
        if self.prefix_cache is None:
            return
        ids = prompt.tolist() + output[:-1]
        if self.held == ids[:len(self.held)]:
            self.held = ids[:self.length]

    def clear(self) -> None:
        """An empty cache at position 0, which the next forward fills from the start (a prefill)."""
        self.cache = self._empty()
        self.position_offset = 0
        self.held = []

    def _empty(self) -> DynamicCache:
        # full-attention layers append in place (`sparrow.runtime.kv_buffer`: transformers' own copy the whole cache
        # every forward)
        cache = buffered(DynamicCache(config=self.model.config))
        # Sliding-window layers (Gemma-3) drop states beyond the window unless they record the past, and
        # then could not be rewound once the window is full; rewind() trims them back to the window.
        cache.activate_past_recording()
        return cache

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None,
                hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """Append `tokens` ([n] int64) after the cached positions. Returns [n, vocab] logits (and hidden states).

        positions: [n] cache-index positions (default: the next n); a tree passes `start + depth`.
        mask: [n, length + n] bool, True = may attend (default: causal); a tree passes its ancestor mask.
        Sliding-window layers additionally see only keys less than `sliding_window` positions back.
        """
        assert tokens.ndim == 1 and tokens.numel() > 0, tuple(tokens.shape)
        assert self.cache is not None, "prefill() must run before forward()"
        n, start = tokens.numel(), self.length
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)
        assert positions.shape == (n,), (tuple(positions.shape), n)
        extra = {}
        if mask is not None:
            assert mask.shape == (n, start + n) and mask.dtype == torch.bool, (tuple(mask.shape), mask.dtype, n, start)
            extra["attention_mask"] = self._attention_mask(mask.to(self.device), positions.to(self.device))
        if self.decoder is not None and not self.decoder.hooked():
            logits, hidden = self.decoder.forward(tokens.to(self.device)[None], self.cache,
                                                  self.position_ids(positions), extra.get("attention_mask"),
                                                  hidden_layers)
            return TargetOutput(logits, hidden)
        out = self.model(
            input_ids=tokens.to(self.device)[None],
            cache=self.cache,
            use_cache=True,
            position_ids=self.position_ids(positions),
            output_hidden_states=bool(hidden_layers),
            **extra,
        )
        return self._output(out, hidden_layers)

    def _output(self, out, hidden_layers: tuple[int, ...]) -> TargetOutput:
        hidden = torch.stack([out.hidden_states[i][0] for i in hidden_layers]) if hidden_layers else None
        return TargetOutput(out.logits[0], hidden)

    def _attention_mask(self, mask: Tensor, positions: Tensor) -> Tensor | dict[str, Tensor]:
        """[n, length + n] bool -> the model's additive 4-D mask; a dict per layer type when some layers
        use a sliding window (their cache hands attention only the keys of `get_mask_sizes`)."""
        n = positions.numel()
        dtype = next(self.model.parameters()).dtype
        full = additive_mask(mask, dtype)
        layer_types = list(getattr(self.config, "layer_types", None) or [])
        if "sliding_attention" not in layer_types:
            return full[None, None]
        window = self.config.sliding_window
        start = self.length
        key_positions = torch.cat([torch.arange(start, device=mask.device), positions])
        near = positions[:, None] - key_positions[None, :] < window  # HF: kv_idx > q_idx - sliding_window
        sliding = full.masked_fill(~near, torch.finfo(dtype).min)
        kv_length, kv_offset = self.cache.get_mask_sizes(n, layer_types.index("sliding_attention"))
        sliding = sliding[:, kv_offset : kv_offset + kv_length]
        return {"full_attention": full[None, None], "sliding_attention": sliding[None, None]}

    @torch.inference_mode()
    def keep(self, start: int, nodes: Tensor) -> None:
        """After scoring [root, *draft nodes] at cache positions start, start + 1, ...: keep the root and the
        draft `nodes` ([m] int64, root to leaf) and drop the other nodes, compacting the cache to start + 1 + m
        positions. For a chain prefix (nodes == arange(m)) this is a plain crop."""
        assert self.cache is not None
        m = nodes.numel()
        scored = self.length - start - 1  # draft nodes in the cache
        assert scored >= m, f"cannot keep {m} of {scored} scored nodes"
        nodes = nodes.to(self.device)
        if m and not bool((nodes == torch.arange(m, device=self.device)).all()):
            for layer in self.cache.layers:
                if not getattr(layer, "is_initialized", False) or layer.keys is None or layer.keys.numel() == 0:
                    continue
                first = layer.keys.shape[-2] - scored  # index of node 0 in this layer's stored keys
                source = nodes + first
                layer.keys[..., first : first + m, :] = layer.keys.index_select(-2, source)
                layer.values[..., first : first + m, :] = layer.values.index_select(-2, source)
        self.rewind(start + 1 + m)

    def rewind(self, length: int) -> None:
        """Drop cached positions >= length. A sliding-window layer can give back only what was fed since the last
        prefill / rewind (they trim it to its window): rewinding into a prompt of a full window is refused."""
        assert self.cache is not None
        surplus = self.length - length
        assert surplus >= 0, f"cannot rewind a cache of length {self.length} forward to {length}"
        for layer in self.cache.layers:  # a sliding layer holds its window plus what was fed since the last rewind
            if isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized and surplus:
                needed = min(layer.sliding_window - 1, layer.get_seq_length() - surplus) + surplus
                assert layer.keys.shape[-2] >= needed, (f"cannot rewind a sliding-window layer by {surplus}: only "
                                                        "states fed since the last prefill or rewind can go")
        self.cache.crop(-surplus)  # transformers >= 5: negative = positions to drop; 0 trims sliding layers
