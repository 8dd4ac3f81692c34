"""The forward of a Llama / Qwen2 causal LM over a sparrow KV cache, without transformers' per-call plumbing.

A decoding step or a verify forward (one to a few dozen tokens after the cache) costs, besides the weights'
matmuls, the time transformers' model forward spends around them: its decorators (output capture, config
defaults, deprecated-argument checks), a module call with hook dispatch for every layer, norm, projection and
activation, keyword arguments rebuilt at every level, output dataclasses. On a CPU, where a step of a 1.5B model on
GGUF blocks takes ~35-45 ms, that is measurable: on an AMD EPYC Zen 4 (2 threads; qwen2.5-coder-1.5b on its Q4_K_M
blocks after 200 cached tokens; `benchmarks/gguf_step.py --variants eager,transformers --rows 1,4,9`, medians of
30 alternated steps; rows in benchmarks/results/gguf_step.jsonl.gz) the step outside the matmuls took 9.1 / 11.6 /
14.4 ms for 1 / 4 / 9 tokens through transformers and 6.7 / 9.2 / 11.8 ms here; whole steps 47.8 / 53.2 / 89.0
against 45.2 / 50.4 / 85.2 ms.

`Decoder.forward` runs the very same computation: each module's own `forward` (so a layer that sparrow switched
in place, `batch_invariant.make_exact`'s or `onednn`'s linears, runs as switched), in the same order, with the mask
transformers builds (`create_causal_mask`, or the caller's 4-D mask as it is) and the attention function the config
names (so `sparrow_sdpa`, `sparrow_rowwise` and a running query capture apply). Logits, hidden states and the
cache are therefore bit for bit transformers' (tests/runtime/test_decoder.py, float32 and bfloat16: one row, causal
chains, tree masks, hidden states, rewinds, exact copies). `plan` admits a model only when that holds by
construction: a `LlamaForCausalLM` or `Qwen2ForCausalLM` built of its architecture's own module classes (a subclass
or a replaced module may compute something else), no sliding-window layers, no module hooks and no forward
replaced on the model or its decoder (a drafter that hooks a decoder, or a counter of forwards, keeps
transformers' forward). Anything else runs through the model's own forward.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ARCHITECTURES = {"LlamaForCausalLM": "Llama", "Qwen2ForCausalLM": "Qwen2"}
"""Model classes `forward` computes, by name -> the prefix of their modules' class names in the same modeling file."""
PARTS = ("Model", "DecoderLayer", "Attention", "MLP", "RMSNorm", "RotaryEmbedding")


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _inlined(module: nn.Module) -> bool:
    """Whether `module`'s forward is its class's: `Decoder.forward` computes what the classes' forwards of the model,
    its decoder, layers, attention and MLP compute (a wrapper set on the instance, which counts or changes its calls,
    would be skipped); the other modules' forwards it calls, as they are."""
    return "forward" not in module.__dict__


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


@dataclass(frozen=True, slots=True)
class Layer:
    """One decoder layer's modules, looked up once (each `nn.Module.__getattr__` is a Python call: ~700 a step of a
    28-layer model, ~0.6 ms of it)."""

    input_norm: nn.Module
    attention: nn.Module
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    post_norm: nn.Module
    gate: nn.Module
    up: nn.Module
    down: nn.Module
    act: Callable
    head_dim: int
    index: int
    scaling: float

    @classmethod
    def of(cls, layer: nn.Module) -> Layer:
        attention, mlp = layer.self_attn, layer.mlp
        return cls(layer.input_layernorm, attention, attention.q_proj, attention.k_proj, attention.v_proj,
                   attention.o_proj, layer.post_attention_layernorm, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
                   mlp.act_fn, attention.head_dim, attention.layer_idx, attention.scaling)


@dataclass(frozen=True)
class Decoder:
    """A model `forward` computes (made by `plan`): its modules as they were then (each called through its `forward`
    as it is at the call, so a forward switched in place later applies; a module replaced later would not, and sparrow
    replaces modules only in copies, before a runner is made) and the functions of its modeling file it calls."""

    model: PreTrainedModel = field(repr=False)
    layers: tuple[Layer, ...] = field(repr=False)
    modeling: str
    """The modeling file's module, whose `apply_rotary_pos_emb` and `eager_attention_forward` the attention calls
    (looked up at each forward: the first is an `nn.Module` wrapper in transformers, which a runner holding it would
    reach and share)."""
    attention_kwargs: dict
    """What the architecture's attention passes to the attention function besides the tensors (Qwen2: its
    `sliding_window`, None)."""

    def hooked(self) -> bool:
        """Whether hooks were set, or the forward replaced, on the model or its decoder since `plan` (which checked
        every module): then the caller runs the model's own forward, which calls them. (Hooks set later on a layer
        or a projection are not looked for at each call, ~400 modules: set them before the runner is made.)"""
        model, inner = self.model, self.model.model
        return _global_hooks() or _hooked(model) or _hooked(inner) or not (_inlined(model) and _inlined(inner))

    def forward(self, input_ids: Tensor, cache, position_ids: Tensor, attention_mask: Tensor | None = None,
                hidden_layers: tuple[int, ...] = ()) -> tuple[Tensor, Tensor | None]:
        """input_ids [1, n] after the cache's positions, position_ids [1, n], attention_mask None (causal) or the
        additive [1, 1, n, length + n] mask transformers takes -> (logits [n, vocab], hidden states
        [len(hidden_layers), n, d] or None), as `model(input_ids=..., cache=cache, use_cache=True,
        position_ids=..., attention_mask=..., output_hidden_states=...)` gives them (`out.logits[0]`,
        `out.hidden_states[i][0]`). The cache takes the new keys and values."""
        inner = self.model.model
        config = inner.config
        embeds = inner.embed_tokens.forward(input_ids)
        if not (isinstance(attention_mask, Tensor) and attention_mask.dim() == 4):
            attention_mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=attention_mask,
                                                cache=cache, position_ids=position_ids)
        modeling = sys.modules[self.modeling]
        # as the attention modules pick it: the implementation their config names, else the file's eager attention
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.layers[0].attention.config._attn_implementation,
                                                       modeling.eager_attention_forward)
        cos, sin = inner.rotary_emb.forward(embeds, position_ids)
        rotary = modeling.apply_rotary_pos_emb
        kwargs = {"position_ids": position_ids, "use_cache": True}  # what a decoder layer hands its attention
        count = len(self.layers) + 1  # hidden states: the embeddings, then every layer's output (the last one normed)
        wanted = {i % count for i in hidden_layers}
        kept: dict[int, Tensor] = {}
        hidden = embeds
        for index, layer in enumerate(self.layers):
            if index in wanted:
                kept[index] = hidden
            # DecoderLayer.forward with its attention and MLP inlined, [1, n, d] -> [1, n, d]
            residual = hidden
            x = layer.input_norm.forward(hidden)
            shape = (*x.shape[:-1], -1, layer.head_dim)
            query = layer.q.forward(x).view(shape).transpose(1, 2)
            key = layer.k.forward(x).view(shape).transpose(1, 2)
            value = layer.v.forward(x).view(shape).transpose(1, 2)
            query, key = rotary(query, key, cos, sin)
            key, value = cache.update(key, value, layer.index, kwargs=kwargs)
            out, _ = attend(layer.attention, query, key, value, attention_mask, dropout=0.0, scaling=layer.scaling,
                            **self.attention_kwargs, **kwargs)
            hidden = residual + layer.o.forward(out.reshape(*x.shape[:-1], -1).contiguous())
            residual = hidden
            x = layer.post_norm.forward(hidden)
            hidden = residual + layer.down.forward(layer.act(layer.gate.forward(x)) * layer.up.forward(x))
        hidden = inner.norm.forward(hidden)
        kept[count - 1] = hidden  # transformers ties the last hidden state to the normed output
        logits = self.model.lm_head.forward(hidden)[0]
        states = torch.stack([kept[i % count][0] for i in hidden_layers]) if hidden_layers else None
        return logits, states


def plan(model: nn.Module) -> Decoder | None:
    """A `Decoder` for `model` where it computes the model's own forward (see the module doc), else None. The hooks
    are checked here over every module, and at each call over the model and its decoder (`Decoder.hooked`)."""
    name = type(model).__name__
    prefix = ARCHITECTURES.get(name)
    modeling = sys.modules.get(type(model).__module__)
    if prefix is None or modeling is None or type(model) is not getattr(modeling, name, None):
        return None
    classes = {part: getattr(modeling, prefix + part, None) for part in PARTS}
    inner = getattr(model, "model", None)
    functions = all(hasattr(modeling, f) for f in ("apply_rotary_pos_emb", "eager_attention_forward"))
    if (not functions or inner is None or type(inner) is not classes["Model"]
            or type(inner.norm) is not classes["RMSNorm"] or type(inner.rotary_emb) is not classes["RotaryEmbedding"]):
        return None
    config = inner.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return None
    used = inner.layers[: config.num_hidden_layers]
    for layer in used:
        if (type(layer) is not classes["DecoderLayer"] or type(layer.self_attn) is not classes["Attention"]
                or type(layer.mlp) is not classes["MLP"] or type(layer.input_layernorm) is not classes["RMSNorm"]
                or type(layer.post_attention_layernorm) is not classes["RMSNorm"]
                or getattr(layer.self_attn, "sliding_window", None) is not None):
            return None
    inlined = [model, inner, *(m for layer in used for m in (layer, layer.self_attn, layer.mlp))]
    if _global_hooks() or any(_hooked(m) for m in model.modules()) or not all(map(_inlined, inlined)):
        return None
    layers = tuple(Layer.of(layer) for layer in used)
    # Qwen2's attention names its sliding window (None for full attention) to the attention function; Llama's none
    extra = {"sliding_window": None} if hasattr(used[0].self_attn, "sliding_window") else {}
    return Decoder(model, layers, modeling.__name__, extra)
