"""Draft-side KV compression policies (MM-ShiftKV, HybridKV) as selectors for the sparse drafter.

Both are KV-cache compression methods that are lossy when applied to a model's own cache. Here they only
choose which prompt KV entries the *draft* (the sparse self-draft, drafters/sparse.py) attends to; the
target verifies with its full, untouched cache, so the output stays exactly the target's. They plug into
the `KVSelector` interface of drafters/kv_selection.py: for one layer they see the post-RoPE queries of
the last w prompt positions ([heads, w, d]) and the prompt keys ([kv_heads, n, d]) and return `budget`
positions per KV head inside `span`.

* `MMShiftKV` (MM-ShiftKV, prefill-only, decode-aware): decoding-time queries vary much more than prefill
  queries, so importance is estimated with *variance-expanded query proxies at future positions*: the
  window queries are aligned to the last prompt position (RoPE is a rotation, so moving a post-RoPE query
  by d positions is a rotation by d * inv_freq), their per-head mean and std give a Gaussian whose std is
  expanded `std_ratio` times (MM-ShiftKV's code hard-codes x10), `groups` x `samples` proxies are drawn
  and rotated to positions last + gap * (1..groups), each proxy is rescaled to the mean query norm (the
  original samples hidden states before the normalising q path; the norm keeps that property). Per (KV
  head, group) the smallest key set covering `coverage` (95 %) of the group's attention mass in the span
  gets one vote; keys are ranked by votes, ties broken by the last prompt token's attention.
  Deviation: the original samples hidden states and runs them through q_proj; the selector interface
  exposes queries only, and q is affine in the normalised hidden state, so we sample in query space.
* `HybridKV` (static/dynamic heads): per KV head, the text-centric attention of the window queries over
  the span; a head whose per-query distributions agree with their mean (histogram intersection >=
  `static_threshold`) is *static* and keeps its top-`budget` keys by mean text attention (text-prior
  pruning); the others are *dynamic* and keep whole chunks of `chunk` consecutive keys, retrieved by the
  strongest attention any window query pays to a chunk (chunk-wise retrieval). Through the selector
  interface the retrieval happens once, at prefill; `HybridKV.retrieve` re-runs it for decoding queries,
  which drafters/draft_kv.py uses to re-choose the dynamic heads' chunks every R rounds (`retrieve_every`).
  Not covered: the top-down layer -> head budget allocation (the interface keeps the same budget for
  every KV head of a layer).

`build_selector(name, model)` returns one by name ("topk" = StD's rule, "mm-shiftkv", "hybridkv").
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparrow.drafters.kv.selection import KVSelector, TopKAttention, check_budget
from sparrow.errors import UserError

SELECTORS = ("topk", "mm-shiftkv", "hybridkv")


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rope_shift(x: Tensor, delta: Tensor, inv_freq: Tensor) -> Tensor:
    """Move post-RoPE vectors x [..., m, d] by `delta` [m] positions (HF's rotate-half RoPE, full rotary dim)."""
    angles = delta.to(torch.float32)[:, None] * inv_freq.to(x.device, torch.float32)[None, :]  # [m, d/2]
    emb = torch.cat([angles, angles], dim=-1)  # [m, d]
    return x * emb.cos() + rotate_half(x) * emb.sin()


def find_inv_freq(model: torch.nn.Module) -> Tensor | None:
    """The decoder's RoPE inverse frequencies [head_dim / 2] (None when the model has no rotary module)."""
    decoder = getattr(getattr(model, "model", model), "language_model", getattr(model, "model", model))
    for module in (decoder, model):
        for name, sub in module.named_modules():
            if name.endswith("rotary_emb") and isinstance(getattr(sub, "inv_freq", None), Tensor):
                return sub.inv_freq.detach().float()
    return None


def covering_set(probs: Tensor, coverage: float) -> Tensor:
    """[..., L] probabilities (rows sum to 1) -> [..., L] bool: the smallest top set covering `coverage`."""
    values, order = probs.sort(dim=-1, descending=True, stable=True)
    before = values.cumsum(-1) - values  # mass of the strictly better keys
    member = before < coverage
    return torch.zeros_like(member).scatter(-1, order, member)


def _rank(primary: Tensor, tie_break: Tensor, budget: int, start: int) -> Tensor:
    """[kv_heads, L] scores -> [kv_heads, budget] sorted positions (+ start) of the best keys."""
    tie = tie_break / tie_break.amax(-1, keepdim=True).clamp_min(1e-30) * 0.5  # in [0, 0.5]
    return (primary + tie).topk(budget, dim=-1).indices.add(start).sort(dim=-1).values


class MMShiftKV:
    """MM-ShiftKV's proxy-vote selection (see the module docstring)."""

    name = "mm-shiftkv"

    def __init__(self, inv_freq: Tensor | None, groups: int = 32, samples: int = 16, gap: int = 8,
                 std_ratio: float = 10.0, coverage: float = 0.95, seed: int = 0) -> None:
        for label, value in (("groups", groups), ("samples", samples), ("gap", gap)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{label} must be an integer >= 1, got {value!r}")
        if not 0.0 < coverage <= 1.0:
            raise UserError(f"coverage must lie in (0, 1], got {coverage!r}")
        if std_ratio < 0:
            raise UserError(f"std_ratio must be >= 0, got {std_ratio!r}")
        self.inv_freq, self.groups, self.samples, self.gap = inv_freq, groups, samples, gap
        self.std_ratio, self.coverage, self.seed = std_ratio, coverage, seed

    def proxies(self, queries: Tensor, layer: int) -> Tensor:
        """[heads, w, d] window queries -> [heads, groups, samples, d] proxies at future positions."""
        heads, w, d = queries.shape
        q = queries.float()
        if self.inv_freq is not None:  # align every window query to the last prompt position
            q = rope_shift(q, torch.arange(w - 1, -1, -1, device=q.device), self.inv_freq)
        mean, std = q.mean(1), q.std(1, unbiased=False)  # [heads, d]
        norm = q.norm(dim=-1).mean(1)  # [heads]
        g = torch.Generator().manual_seed(self.seed * 100_003 + layer)  # deterministic, per layer
        noise = torch.randn(self.groups, self.samples, heads, d, generator=g).to(q.device)
        x = mean + self.std_ratio * std * noise  # [groups, samples, heads, d]
        x = x * (norm / x.norm(dim=-1).clamp_min(1e-12))[..., None]  # keep the query norm (normalised path)
        x = x.permute(2, 1, 0, 3)  # [heads, samples, groups, d]
        if self.inv_freq is not None:  # group j sits gap * (j + 1) positions after the prompt
            x = rope_shift(x, self.gap * torch.arange(1, self.groups + 1, device=q.device), self.inv_freq)
        x = x.transpose(1, 2)  # [heads, groups, samples, d]
        return x

    def __call__(self, queries: Tensor, keys: Tensor, budget: int, span: tuple[int, int], *, layer: int,
                 scaling: float) -> Tensor:
        start, end = span
        kv_heads = keys.shape[0]
        heads = queries.shape[0]
        k = keys.float()
        proxies = self.proxies(queries, layer)  # [heads, G, S, d]
        votes = torch.zeros(kv_heads, end - start, device=keys.device)
        n, d = k.shape[1], k.shape[2]
        for kv in range(kv_heads):  # one KV head and a few groups at a time: bounded memory for long prompts
            p = proxies[kv * heads // kv_heads:(kv + 1) * heads // kv_heads]  # [gh, G, S, d]
            gh = p.shape[0]
            step = max(1, 2**25 // (gh * self.samples * n))
            masses = []
            for g0 in range(0, self.groups, step):
                chunk = p[:, g0:g0 + step]
                attn = (chunk.reshape(gh, -1, d) @ k[kv].T * scaling).softmax(-1)  # [gh, g*S, n]
                masses.append(attn.reshape(gh, chunk.shape[1], self.samples, n).sum(2).mean(0)[:, start:end])
            mass = torch.cat(masses)  # [G, L]
            mass = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)  # within the span
            votes[kv] = covering_set(mass, self.coverage).sum(0).float()
        last = queries[:, -1].float().reshape(kv_heads, heads // kv_heads, d) @ k.transpose(1, 2) * scaling
        last = last.softmax(-1).mean(1)[:, start:end]  # [kv_heads, L]: the last prompt token's attention
        return _rank(votes, last, budget, start)


def text_attention(queries: Tensor, keys: Tensor, span: tuple[int, int], scaling: float) -> Tensor:
    """[kv_heads, w, L]: attention of each window query to the span keys, GQA-averaged, renormalised over
    the span (span keys lie before the window, so no causal mask is needed)."""
    start, end = span
    kv_heads = keys.shape[0]
    heads = queries.shape[0]
    w, d = queries.shape[1:]
    q = queries.float().reshape(kv_heads, heads // kv_heads * w, d)  # GQA: the heads sharing a KV head
    attn = (q @ keys.float().transpose(1, 2) * scaling).softmax(-1)[..., start:end]  # [kv_heads, g*w, L]
    attn = attn.reshape(kv_heads, heads // kv_heads, w, -1).mean(1)
    return attn / attn.sum(-1, keepdim=True).clamp_min(1e-30)


def head_stability(attn: Tensor) -> Tensor:
    """[kv_heads, w, L] per-query distributions -> [kv_heads] mean histogram intersection with their mean."""
    mean = attn.mean(1, keepdim=True)
    return torch.minimum(attn, mean).sum(-1).mean(-1)


class HybridKV:
    """HybridKV's static/dynamic head split (see the module docstring)."""

    name = "hybridkv"

    def __init__(self, static_threshold: float = 0.5, chunk: int = 16) -> None:
        if not 0.0 <= static_threshold <= 1.0:
            raise UserError(f"static_threshold must lie in [0, 1], got {static_threshold!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise UserError(f"chunk must be an integer >= 1, got {chunk!r}")
        self.static_threshold, self.chunk = static_threshold, chunk
        self.last_static: dict[int, Tensor] = {}  # layer -> [kv_heads] bool, for inspection

    def chunk_retrieval(self, attn: Tensor, budget: int) -> Tensor:
        """[w, L] one head's query distributions -> [budget] span offsets: best chunks first, the last chunk
        cut to its best keys by mean attention."""
        w, length = attn.shape
        pad = -length % self.chunk
        per_chunk = torch.nn.functional.pad(attn, (0, pad)).reshape(w, -1, self.chunk).sum(-1)  # [w, C]
        order = per_chunk.amax(0).argsort(descending=True, stable=True)
        mean = attn.mean(0)
        picked = []
        left = budget
        for c in order.tolist():
            offsets = torch.arange(c * self.chunk, min((c + 1) * self.chunk, length), device=attn.device)
            if offsets.numel() > left:
                offsets = offsets[mean[offsets].topk(left).indices]
            picked.append(offsets)
            left -= offsets.numel()
            if left == 0:
                break
        return torch.cat(picked).sort().values

    def retrieve(self, queries: Tensor, keys: Tensor, budget: int, scaling: float) -> Tensor:
        """Chunk-wise retrieval for decoding: queries [heads, t, d] (the newest draft tokens' post-RoPE queries),
        keys [kv_heads, L, d] (a span's keys, all before the queries) -> [kv_heads, budget] span offsets,
        each row sorted."""
        heads, kv_heads = queries.shape[0], keys.shape[0]
        assert heads % kv_heads == 0 and 1 <= budget <= keys.shape[1], (tuple(queries.shape), tuple(keys.shape),
                                                                          budget)
        attn = text_attention(queries, keys, (0, keys.shape[1]), scaling)  # [kv_heads, t, L]
        return torch.stack([self.chunk_retrieval(attn[kv], budget) for kv in range(kv_heads)])

    def __call__(self, queries: Tensor, keys: Tensor, budget: int, span: tuple[int, int], *, layer: int,
                 scaling: float) -> Tensor:
        start, end = span
        attn = text_attention(queries, keys, span, scaling)  # [kv_heads, w, L]
        static = head_stability(attn) >= self.static_threshold
        self.last_static[layer] = static
        rows = []
        for kv in range(keys.shape[0]):
            if static[kv]:  # text-prior pruning
                rows.append(attn[kv].mean(0).topk(budget).indices.sort().values)
            else:  # chunk-wise retrieval
                rows.append(self.chunk_retrieval(attn[kv], budget))
        return torch.stack(rows).add(start)


def build_selector(name: str, model: torch.nn.Module | None = None, **options) -> KVSelector:
    """A draft-KV selector by name: "topk" (StD), "mm-shiftkv" (needs the model for its RoPE), "hybridkv"."""
    if name == "topk":
        return TopKAttention()
    if name == "mm-shiftkv":
        return MMShiftKV(find_inv_freq(model) if model is not None else None, **options)
    if name == "hybridkv":
        return HybridKV(**options)
    raise UserError(f"unknown draft KV policy {name!r}; expected one of: {', '.join(SELECTORS)}")


def configure_draft_kv(drafter, policy: str | None, budget: int | float | None) -> None:
    """Point a built sparse drafter at a draft-KV policy by name and/or a new visual KV budget
    (takes effect at its next prefill; the target's cache is never touched)."""
    if not (hasattr(drafter, "selector") and hasattr(drafter, "budget")):
        raise UserError(f"configure_draft_kv re-points the sparse drafter, not {getattr(drafter, 'name', drafter)!r}; "
                        "build visual-prune / draft-model with draft_kv=... (and draft_kv_budget=) instead")
    if budget is not None:
        check_budget(budget)
        drafter.budget = budget
    if policy is not None:
        drafter.selector = build_selector(policy, drafter.model)
