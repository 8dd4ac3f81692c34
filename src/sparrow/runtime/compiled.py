"""StaticCachedModel: a CachedModel over a preallocated (static) KV cache whose single-token and verify
forwards can run through `torch.compile` (gpt-fast's low-overhead decode path, behind CachedModel's interface).

Cache: transformers' `StaticCache`; every layer holds [1, kv_heads, capacity, head_dim] keys and values and a
0-d length counter (`cumulative_length`, a tensor, so its value is no compile guard). A forward of n tokens
writes slots length .. length + n - 1. Rollback is positional: `rewind` sets the counters; the entries at slots
>= length stay where they are, but every query attends only slots it is allowed to (at most its own), and the
next forward overwrites them. `keep` (trees) index-copies the kept nodes' entries down to the slots after the
root, then rewinds.

Shapes: the prefill runs eagerly (one forward of any length). `forward` pads its n tokens to the next size in
its buckets (`Q_BUCKETS`; `FINE_BUCKETS` on GGUF block kernels), so a handful of static shapes cover every draft
and verify step: padding rows come after the real rows (no real row attends them; they attend causally, so they
stay finite), and the counters are set back to start + n inside the step. The attention mask is always
explicit, [1, 1, bucket, capacity] over all slots. The capacity is a power of two >= the prompt + `HEADROOM`; a
forward that would overflow it moves the cache into one twice as large (a new shape: a compiled step compiles
again).

Compilation (`compile=True`): the step (mask, model forward, counter fix) is one `torch.compile`d graph per
(bucket, capacity, hidden layers). Default mode: "reduce-overhead" (CUDA graphs) on CUDA; elsewhere inductor's
default with `freezing`: the weights become graph constants that inductor prepacks for oneDNN's linears (it
keeps a second, prepacked copy of the weights, and weights changed in place after a compile go unseen). Under
CUDA graphs the outputs live in graph-owned memory that the next replay overwrites, so they are cloned.
Every runner compiles its own copy of the step's code, and its graphs skip dynamo's guards on the model's modules
(checking each parameter cost ~1.4 ms a step on a 1.5B): a module changed after the first compile goes unseen
(nothing in sparrow changes one; drafters that switch the target's attention are refused with compile).
Attention packs the query heads that share a KV head as rows of it (`sparrow.runtime.attention.decode`): a
single query row over the whole static capacity otherwise ran ~10x slower, on copied keys.
`compile=False` keeps the static cache with eager forwards (no compile time).

Exact rows: the default (CPU) mode compiles with INVARIANT_OPTIONS: inductor's `emulate_precision_casts` (a fused
kernel rounds each op's result to the model's dtype where eager does) and no generated kernel split across threads
(`cpp.min_chunk_size`). Without them inductor fused and split each bucket its own way: on the int4 1.5B (Zen 5)
the 2-, 4- and 8-row graphs' logits were up to 0.125 away from the one-row graph's, and with either option alone
the 8-row graph still was on some prompts; with both they are bit-identical (`benchmarks/compiled_rows.py`; the
one-row step 28-29 ms either way). Attention stays a library call whose packed query rows are padded past torch's
short query blocks (`sparrow.runtime.attention.decode.padding`: a block of a few rows went through another BLAS
kernel). A model whose every linear layer runs a row-invariant quantized kernel (int8 / int4 weight-only, or GGUF
blocks: `GGUFLinear`) then verifies exactly as its one-row steps decode (`row_invariant`;
tests/runtime/test_compiled.py, tests/models/test_gguf_native.py); a dense layer's compiled matmul is not
row-invariant.

Not supported: VLMs (their prefill and positions go through `sparrow.runtime.vision`) and models with
sliding-window layers (Gemma-3): a static sliding layer is a ring buffer, which cannot be rewound.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from sparrow.errors import UserError
from sparrow.runtime.cached_model import CachedModel, additive_mask, prefill_module
from sparrow.runtime.gguf_linear import GGUFLinear
from sparrow.runtime.quant import DynamicInt8Linear, QuantizedLinear
from sparrow.types import Prompt, TargetOutput

Q_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Forward sizes the step is compiled for; a forward of more tokens than the last bucket runs eagerly."""
FINE_BUCKETS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 64)
"""The sizes for a model on GGUF block kernels (`buckets_for`): their rows are compute (every activation row of a
verify costs its integer dot products: a 9-row verify padded to 16 rows took 247 ms on the 1.5B, Zen 4, against
172 ms eager); with these no forward up to 32 rows pays more than 1.5x its rows (10 graphs to compile, not 7)."""
HEADROOM = 256
"""Slots a fresh cache leaves after the prompt (it doubles when they run out)."""
INVARIANT_OPTIONS = {"emulate_precision_casts": True, "cpp.min_chunk_size": 1 << 30}
"""Inductor options (CPU) that keep a k-row step's rows equal to one-row steps (see the module doc): fused kernels
round each op's result to the model's dtype where eager does, and no generated kernel splits its loops across
threads (the matmuls and attention are library calls with their own threads)."""
INVARIANT_ROWS = True
"""Whether the default mode compiles with INVARIANT_OPTIONS; `benchmarks/compiled_rows.py --no-invariant` turns
them off to measure what they buy."""
RECOMPILE_LIMIT = 64
"""Graphs a runner's step may hold: dynamo counts them per code object (one per runner: buckets x capacities x
hidden-layer choices), and its default (8) would fall back to eager. The first compiled runner raises the
process-wide `torch._dynamo.config.recompile_limit` to this (never lowers it): patching it around each call
instead cost milliseconds a step."""


def traceable(model: PreTrainedModel) -> bool:
    """Whether torch.compile can trace the model's layers: not w8a8 ones (fbgemm's packed int8 weights are an
    opaque object dynamo cannot put in a graph)."""
    return not any(isinstance(m, DynamicInt8Linear) for m in model.modules())


def row_invariant(model: nn.Module) -> bool:
    """Whether the compiled steps of `model` compute each row of a verify forward as its one-row step does (see
    the module doc): on the CPU, every linear layer a weight-only quantized one (torch's int8 / int4 kernels keep
    their rows) or a GGUF block one (`GGUFLinear`: its kernels are batch-invariant by construction); a dense or
    w8a8 layer, or one that runs long forwards densely, does not qualify."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, QuantizedLinear, DynamicInt8Linear, GGUFLinear))]
    invariant = all(type(m) is GGUFLinear or (type(m) is QuantizedLinear and m.dense is None) for m in layers)
    return bool(layers) and invariant and next(model.parameters()).device.type == "cpu"


def check_compilable(model: PreTrainedModel) -> None:
    """Refuse models the static path cannot run, naming why (a UserError)."""
    check_compilable_config(model.config, type(model).__name__)
    if not traceable(model):
        raise UserError("compile: w8a8 models (--quant w8a8) cannot be compiled (torch.compile cannot trace "
                        "fbgemm's packed int8 weights); drop --compile, or use --quant int8 / int4")


def check_compilable_config(config: PretrainedConfig, what: str) -> None:
    """Refuse, from its config alone (before its weights load), a model `what` the static path cannot run: a VLM,
    or one with sliding-window or non-attention layers."""
    if getattr(config, "vision_config", None) is not None:
        raise UserError(f"compile: vision-language models ({what}) are not supported; drop --compile / compile=True")
    if windowed(config):
        raise UserError(f"compile: models with sliding-window or non-attention layers ({what}) are not supported "
                        "(a static sliding-window cache cannot be rewound); drop --compile")


def windowed(config: PretrainedConfig) -> bool:
    """Whether some decoder layer of the model is not full attention (a sliding window keeps only its last keys)."""
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or []
    return any(kind != "full_attention" for kind in layer_types) or bool(getattr(text, "use_sliding_window", False))


def _own_step(runner: StaticCachedModel) -> Callable:
    """`runner._step` as a method of its own copy of the code: dynamo keeps its graphs per code object, so no
    runner's graph ever serves another (their guards skip the modules, see the module doc)."""
    step = StaticCachedModel._step
    own = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__,
                             step.__closure__)
    return types.MethodType(own, runner)


def buckets_for(model: nn.Module) -> tuple[int, ...]:
    """The forward sizes to compile `model`'s step for: FINE_BUCKETS where its linear layers run GGUF block kernels
    (rows cost compute), else Q_BUCKETS (torch's kernels read the weights once whatever the rows: a padded row costs
    little, a graph more to compile)."""
    return FINE_BUCKETS if any(type(m) is GGUFLinear for m in model.modules()) else Q_BUCKETS


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest of `buckets` >= n (None: larger than every bucket)."""
    return next((b for b in buckets if b >= n), None)


def _capacity(needed: int) -> int:
    """A power of two >= needed (at least HEADROOM)."""
    return max(HEADROOM, 1 << (needed - 1).bit_length())


class StaticCachedModel(CachedModel):
    """CachedModel with a static KV cache and (optionally) compiled forwards; see the module doc."""

    def __init__(self, model: PreTrainedModel, compile: bool = True, mode: str | None = None,
                 freeze: bool | None = None) -> None:
        """compile: torch.compile the step (False: the static cache with eager forwards). mode: torch.compile's
        (default: "reduce-overhead" on CUDA, else "default"). freeze: inductor's freezing (default: on CPUs)."""
        check_compilable(model)
        super().__init__(model)
        self.cache: StaticCache | None = None
        self._length = 0  # positions the cache holds (mirrors the layers' counters without reading them)
        self.dtype = model.get_input_embeddings().weight.dtype  # activations' (quantized models keep dense embeddings)
        self.compiled = compile
        if mode is None:
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
        self.mode = mode
        self.freeze = compile and (self.device.type == "cpu" if freeze is None else freeze)
        self._graph_outputs = compile and mode == "reduce-overhead"  # CUDA graphs: outputs are overwritten
        self._steps: dict[bool, Callable] = {}  # one row?: its compiled step
        if compile:
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
            self._steps = {True: self._compiled(one_row=True), False: self._compiled(one_row=False)}
        self._slots: Tensor | None = None  # [capacity] int64: slot indices, for the masks
        self.buckets = buckets_for(model)
        self._pads = [torch.tensor(pad, device=self.device) for pad in range(self.buckets[-1])]  # 0-d step inputs

    def _compiled(self, one_row: bool) -> Callable:
        """The step, compiled: with CUDA graphs a torch.compile mode (which takes no inductor options); else
        inductor's options: freezing, no guards on the modules, and for one-row steps (every plain token, every
        draft step) a C++ wrapper around the graph's kernels (~1 ms less a step on an int4 1.5B, Zen 5; compiling ~3x
        as long, so the verify buckets keep the Python wrapper)."""
        step = _own_step(self)
        if self.mode != "default":
            return torch.compile(step, dynamic=False, fullgraph=True, mode=self.mode)
        options = {"freezing": self.freeze, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                   "cpp_wrapper": one_row and self.device.type == "cpu"}
        if INVARIANT_ROWS:
            options.update(INVARIANT_OPTIONS)
        return torch.compile(step, dynamic=False, fullgraph=True, options=options)

    @property
    def capacity(self) -> int:
        return self._slots.numel() if self._slots is not None else 0

    @property
    def length(self) -> int:
        return self._length if self.cache is not None else 0

    # --- the cache ------------------------------------------------------------------------------------------

    def _allocate(self, capacity: int) -> None:
        """A fresh StaticCache of `capacity` slots (its layers allocate, and mark as static addresses, at the first
        update: the eager prefill or `_grow`)."""
        cache = StaticCache(config=self.model.config, max_cache_len=capacity)
        if any(type(layer) is not StaticLayer for layer in cache.layers):  # what check_compilable cannot see
            raise UserError(f"compile: {type(self.model).__name__} has cache layers other than full attention; "
                            "drop --compile")
        self.cache = cache
        self._slots = torch.arange(capacity, device=self.device)

    def _grow(self, needed: int) -> None:
        """Move the cache into one of capacity >= needed, keeping its first `length` slots."""
        old = self.cache
        self._allocate(_capacity(needed))
        n = self._length
        for new_layer, old_layer in zip(self.cache.layers, old.layers):
            new_layer.update(old_layer.keys[:, :, :n], old_layer.values[:, :, :n])  # allocates, writes slots :n
        self._set_length(n)

    def _set_length(self, length: int) -> None:
        """Every layer's counter to `length` (two fused ops, whatever the depth)."""
        counters = [layer.cumulative_length for layer in self.cache.layers]
        torch._foreach_mul_(counters, 0)
        torch._foreach_add_(counters, length)
        self._length = length

    # --- forwards ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """Reset the cache and run the prompt eagerly. Returns the logits of the last prompt row ([1, vocab]) and,
        when asked for, every prompt row's hidden states. The cache (and so the compiled graphs' shapes) is reused
        while its capacity is within 2x of what this prompt would allocate."""
        n = prompt.input_ids.numel()
        self.position_offset = 0
        wanted = _capacity(n + HEADROOM)
        if self.cache is None or not wanted <= self.capacity <= 2 * wanted:
            self._allocate(wanted)
        self._set_length(0)
        out = prefill_module(self.model)(input_ids=prompt.input_ids.to(self.device)[None], cache=self.cache,
                                         use_cache=True, logits_to_keep=1, output_hidden_states=bool(hidden_layers),
                                         **prompt.model_inputs)
        self._length = n
        return self._output(out, hidden_layers)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None,
                hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """As CachedModel.forward: `tokens` ([n] int64) after the cached positions -> [n, vocab] logits.

        positions: [n] cache-index positions (default: the next n); mask: [n, length + n] bool (default: causal).
        Runs as a padded bucket of the compiled step (eagerly beyond the last bucket)."""
        assert tokens.ndim == 1 and tokens.numel() > 0, tuple(tokens.shape)
        assert self.cache is not None, "prefill() must run before forward()"
        n, start = tokens.numel(), self._length
        fits = _bucket(n, self.buckets)  # None: more rows than the last bucket, run eagerly at n
        bucket = fits or n
        if start + bucket > self.capacity:
            self._grow(start + bucket + HEADROOM)
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)
        assert positions.shape == (n,), (tuple(positions.shape), n)
        if mask is not None:
            assert mask.shape == (n, start + n) and mask.dtype == torch.bool, (tuple(mask.shape), mask.dtype, n, start)
        tokens, positions, allowed = self._padded(tokens, positions.to(self.device), mask, bucket)
        step = self._steps.get(bucket == 1, self._step) if fits is not None else self._step
        logits, hidden = step(tokens[None], self.position_ids(positions), allowed, self._pads[bucket - n],
                              hidden_layers)
        self._length = start + n
        if self._graph_outputs:
            logits, hidden = logits.clone(), hidden.clone() if hidden is not None else None
        return TargetOutput(logits[:n], hidden[:, :n] if hidden is not None else None)

    def _padded(self, tokens: Tensor, positions: Tensor, mask: Tensor | None,
                bucket: int) -> tuple[Tensor, Tensor, Tensor]:
        """n tokens ([n]), their cache-index positions ([n]) and mask ([n, length + n] bool or None: causal) padded
        to `bucket` rows: -> tokens [bucket], positions [bucket], allowed [bucket, capacity] bool over all slots.
        Padding rows follow the last real position and attend causally by slot (so they stay finite)."""
        n, start = tokens.numel(), self._length
        rows = torch.arange(bucket, device=self.device)
        allowed = self._slots[None, :] <= start + rows[:, None]  # causal by slot: no real row sees a later slot
        if mask is not None:
            allowed[:n, : start + n] = mask.to(self.device)
        tokens = tokens.to(self.device)
        if not tokens.is_inference():  # a caller's tensor from outside inference mode: dynamo would guard on its
            tokens = tokens.clone()  # dispatch keys and compile every bucket a second time (once per kind)
        if bucket > n:
            tokens = torch.cat([tokens, tokens.new_zeros(bucket - n)])
            positions = torch.cat([positions, positions[-1] + 1 + rows[: bucket - n]])
        return tokens, positions, allowed

    def _step(self, tokens: Tensor, position_ids: Tensor, allowed: Tensor, pad: Tensor,
              hidden_layers: tuple[int, ...]) -> tuple[Tensor, Tensor | None]:
        """One padded forward (the compiled graph): tokens [1, b] int64, position_ids [1, b], allowed [b, capacity]
        bool, pad: 0-d int64, rows of padding at the end. Returns [b, vocab] logits and [len(hidden_layers), b, d]
        hidden states (or None); the counters end at start + b - pad."""
        out = self.model(input_ids=tokens, position_ids=position_ids, cache=self.cache, use_cache=True,
                         attention_mask=additive_mask(allowed, self.dtype)[None, None],
                         output_hidden_states=bool(hidden_layers))
        for layer in self.cache.layers:
            layer.cumulative_length.sub_(pad)
        hidden = torch.stack([out.hidden_states[i][0] for i in hidden_layers]) if hidden_layers else None
        return out.logits[0], hidden

    @torch.inference_mode()
    def warm_up(self, prompt: Prompt, hidden_layers: tuple[int, ...] = (), largest: int | None = None) -> None:
        """Compile the step of every bucket a forward of up to `largest` rows runs in (None: every bucket), with
        `hidden_layers`, at the capacity `prompt` allocates (each first call of a shape compiles: tens of seconds on
        a CPU, which would otherwise fall inside a generation); the cache is left empty."""
        self.prefill(prompt)
        start = self._length
        last = self.buckets[-1] if largest is None else _bucket(largest, self.buckets) or self.buckets[-1]
        for bucket in self.buckets:
            if bucket > last or start + bucket > self.capacity:
                break
            self.forward(prompt.input_ids[-1:].expand(bucket).contiguous(), hidden_layers=hidden_layers)
            self.rewind(start)
        self.rewind(0)

    # --- rollback ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def keep(self, start: int, nodes: Tensor) -> None:
        """As CachedModel.keep: after scoring [root, *nodes] at slots start, start + 1, ...: keep the root and
        `nodes` ([m] int64, root to leaf), index-copied down to slots start + 1 .. start + m."""
        assert self.cache is not None
        m = nodes.numel()
        scored = self._length - start - 1
        assert scored >= m, f"cannot keep {m} of {scored} scored nodes"
        nodes = nodes.to(self.device)
        if m and not bool((nodes == torch.arange(m, device=self.device)).all()):
            source = nodes + start + 1
            for layer in self.cache.layers:
                layer.keys[:, :, start + 1 : start + 1 + m] = layer.keys.index_select(2, source)
                layer.values[:, :, start + 1 : start + 1 + m] = layer.values.index_select(2, source)
        self.rewind(start + 1 + m)

    @torch.inference_mode()
    def rewind(self, length: int) -> None:
        """Drop cached positions >= length: the counters move back; the stale slots are masked, then overwritten."""
        assert self.cache is not None
        assert 0 <= length <= self._length, f"cannot rewind a cache of length {self._length} to {length}"
        if length != self._length:
            self._set_length(length)


__all__ = ["FINE_BUCKETS", "HEADROOM", "Q_BUCKETS", "StaticCachedModel", "buckets_for", "check_compilable"]
