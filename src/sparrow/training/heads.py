"""Training an EAGLE head on its target's own outputs: features, EAGLE-3's training-time test, AdamW.

Features (`extract_features`): the target runs once over each token sequence; the head's inputs are the
target's hidden states of its layers, the labels the target's next-token distributions (self-distillation:
any text works as context, the target supplies what the head must predict).

Training-time test (EAGLE-3, Li et al. 2025): step j = 0 .. ttt_steps - 1 runs the head over every row t
with the token x[t + 1 + j] and, as hidden input, the target features (j = 0) or the head's own output of
step j - 1, at position t + j, as it will at depth j + 1 while drafting. Row t of step j attends to the
step-0 rows <= t (the context) and to its own rows of steps 1 .. j. Its loss is the soft cross-entropy
against the target's distribution at position t + 1 + j (restricted and renormalised to the draft vocabulary;
rows whose target argmax is outside it are skipped), weighted decay^j. EAGLE-1 heads add EAGLE-1's feature
regression (smooth L1 towards the target's next feature, `feature_weight`).

Labels are the target's top-k next tokens with their log-probabilities (`top_k`, 32 by default), not its full
logits: a 152k vocabulary would need 600 KB per position. The soft cross-entropy renormalises over the top-k
ids inside the draft vocabulary; with top_k = vocabulary size it is the full-distribution loss.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import Tensor, nn

from sparrow.errors import UserError
from sparrow.heads.eagle import EagleHead
from sparrow.heads.factory import new_head
from sparrow.training.longspec import train_longspec
from sparrow.training.loop import Evaluation, StepResult, TrainReport, draw_batch, mean_loss_step, new_optimiser

if TYPE_CHECKING:
    from sparrow.models import LoadedModel
    from sparrow.runtime.cached_model import CachedModel

Target = Union["LoadedModel", "CachedModel", nn.Module]
"""A target as the caller has it: a LoadedModel, a CachedModel, or the transformers causal LM itself."""


@dataclass(frozen=True)
class Features:
    """One sequence as the head trains on it."""

    tokens: Tensor  # [n] int64 target ids
    hidden: Tensor  # [n, fused_width] the target's hidden states of the head's layers, concatenated
    label_ids: Tensor  # [n, k] int64: row t holds the target's k likeliest tokens t + 1, likeliest first
    label_logprobs: Tensor  # [n, k] float32: their log-probabilities under the target's full softmax

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        assert self.tokens.ndim == 1 and self.hidden.shape[0] == n and self.label_ids.shape[0] == n, (
            tuple(self.tokens.shape), tuple(self.hidden.shape), tuple(self.label_ids.shape))
        assert self.label_logprobs.shape == self.label_ids.shape, (
            tuple(self.label_logprobs.shape), tuple(self.label_ids.shape))


def _model(target: Target) -> nn.Module:
    """A LoadedModel, CachedModel or transformers model -> the transformers model."""
    return getattr(target, "model", target)


DEFAULT_TOP_K = 32


def top_labels(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """[n, vocab] logits -> the k likeliest ids [n, k] int64 (likeliest first) and their float32 log-probs."""
    logprobs, ids = logits.float().log_softmax(-1).topk(min(top_k, logits.shape[-1]), dim=-1)
    return ids, logprobs


@torch.no_grad()
def features_of(model: nn.Module, layers: Sequence[int], tokens: Tensor, top_k: int = DEFAULT_TOP_K) -> Features:
    """One target forward over `tokens` ([n], n >= 2) -> its Features (hidden states in the target's dtype)."""
    assert tokens.ndim == 1 and tokens.numel() >= 2, tuple(tokens.shape)
    tokens = tokens.to(next(model.parameters()).device)
    result = model(input_ids=tokens[None], output_hidden_states=True, use_cache=False)
    hidden = torch.cat([result.hidden_states[i][0] for i in layers], -1)  # [n, len(layers) * D]
    return Features(tokens, hidden, *top_labels(result.logits[0], top_k))


def extract_features(target: Target, layers: Sequence[int], sequences: Sequence[Tensor],
                     top_k: int = DEFAULT_TOP_K) -> list[Features]:
    """Run the target (LoadedModel, CachedModel or transformers causal LM) over each [n] sequence (n >= 2), in
    memory (`sparrow.training.features.FeatureCache`: the same on disk, resumable)."""
    model = _model(target)
    return [features_of(model, layers, tokens, top_k) for tokens in sequences]


def frequent_tokens(sequences: Sequence[Tensor], size: int, vocab_size: int, always: Sequence[int] = ()) -> Tensor:
    """The `size` most frequent target ids in `sequences` (FR-Spec), `always` included: a draft vocabulary
    ([size] int64, sorted). Ties go to the lower id."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for tokens in sequences:
        counts += torch.bincount(tokens.cpu(), minlength=vocab_size)[:vocab_size].double()
    counts[list(always)] = float("inf")
    counts -= torch.arange(vocab_size, dtype=torch.float64) * 1e-9  # stable tie-break
    return counts.topk(size).indices.sort().values


INITS = ("none", "lm_head", "layer")
"""What of a fresh EAGLE-3 head starts from its target (`fresh_head`'s `init`): nothing (all random); "lm_head" its
final norm and the LM-head rows of the draft vocabulary; "layer" those and the target's last decoder layer (see
`copy_last_layer`)."""


def default_init(arch: str, fusion: str) -> str:
    """`--init-from-target`'s default: the target's last layer where the head can take it (an EAGLE-3 head with
    concatenation fusion: +0.039 expected tokens a round at a fixed budget, docs/heads.md "Convergence on the CPU"),
    else its norm and LM head."""
    return "layer" if arch == "eagle3" and fusion == "concat" else "lm_head"


def init_from_target(head: EagleHead, model: nn.Module, layer: bool = False) -> None:
    """Start an EAGLE-3 head's norm and LM head from the target's final norm and LM head rows of the draft
    vocabulary (the head's output then begins as a reading of a target-like state; it trains from there), and with
    `layer` its decoder layer and fc from the target's last layer (`copy_last_layer`); a LongSpec head's norm from
    the target's final norm."""
    if layer and (head.config.arch != "eagle3" or head.config.fusion != "concat"):
        raise UserError("initialising from the target's last layer needs an EAGLE-3 head with concatenation fusion "
                        "(--init-from-target lm_head)")
    if head.config.arch not in ("eagle3", "longspec"):
        return
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    with torch.no_grad():
        if head.config.arch == "eagle3":  # a LongSpec head drafts through the target's own LM head: its norm only
            weight = model.get_output_embeddings().weight
            head.lm_head.weight.copy_(weight[head.draft_to_target].to(head.lm_head.weight))
        if (
            norm is not None
            and getattr(norm, "weight", None) is not None
            and norm.weight.shape == head.norm.weight.shape
        ):
            head.norm.weight.copy_(norm.weight.to(head.norm.weight))
    if layer:
        copy_last_layer(head, model)


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


@torch.no_grad()
def copy_last_layer(head: EagleHead, model: nn.Module) -> None:
    """An EAGLE-3 head's first decoder layer from the target's last one, and its fc as a reading of the highest
    target layer it fuses: q/k/v's columns over the hidden half of cat(norm(embedding), norm(h)) get the target's
    q/k/v (the embedding half stays random), o_proj, the MLP (its first `intermediate_size` units when the head's
    is narrower; the target's units first and the rest random when wider), hidden_norm the target's input norm,
    post_attention_layernorm its own; fc's block over the highest fused layer becomes the identity (the head then
    starts as the target's last layer over that layer's state). Biases (Qwen2's q/k/v) are not copied: the head
    has none. A head whose attention is shaped otherwise than the target's is refused."""
    c = head.config
    if c.arch != "eagle3" or c.fusion != "concat":
        raise UserError("initialising from the target's last layer needs an EAGLE-3 head with concatenation fusion")
    source = model.get_decoder().layers[-1]
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
    missing = [name for name in names if not _has(source, name)]
    if missing:
        raise UserError(f"the target's last layer has no {', '.join(missing)} (not a Llama-style layer): start the "
                        "head from its LM head only (--init-from-target lm_head)")
    mine, attn = head.midlayer, source.self_attn
    d = c.hidden_size
    pairs = [(mine.self_attn.q_proj, attn.q_proj), (mine.self_attn.k_proj, attn.k_proj),
             (mine.self_attn.v_proj, attn.v_proj)]
    for ours, theirs in pairs:
        if ours.weight.shape != (theirs.weight.shape[0], 2 * theirs.weight.shape[1]) or c.target_hidden_size != d:
            raise UserError(f"the head's attention {tuple(ours.weight.shape)} is not shaped like the target's "
                            f"{tuple(theirs.weight.shape)}: it cannot start from the target's last layer "
                            "(--init-from-target lm_head)")
        ours.weight[:, d:].copy_(theirs.weight.to(ours.weight))
    mine.self_attn.o_proj.weight.copy_(attn.o_proj.weight.to(mine.self_attn.o_proj.weight))
    units = min(c.intermediate_size, source.mlp.gate_proj.weight.shape[0])
    for name in ("gate_proj", "up_proj"):
        getattr(mine.mlp, name).weight[:units].copy_(getattr(source.mlp, name).weight[:units])
    mine.mlp.down_proj.weight[:, :units].copy_(source.mlp.down_proj.weight[:, :units])
    mine.hidden_norm.weight.copy_(source.input_layernorm.weight.to(mine.hidden_norm.weight))
    mine.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
    width = c.target_hidden_size
    head.fc.weight[:, -width:].copy_(torch.eye(d, width))  # [d, D], d = D


def fresh_head(model: nn.Module, arch: str, seed: int, draft_vocab: Tensor | None, init: str = "lm_head",
               **shape: Any) -> EagleHead:
    """A new float32 head of `arch` for `model` (weights drawn from `seed`; `shape`: new_head's options), started
    from the target as `init` (one of INITS) says: by default its norm and LM head (`init_from_target`)."""
    if init not in INITS:
        raise UserError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    head = new_head(model, arch, generator, draft_vocab=draft_vocab, **shape).float()
    if init != "none":
        init_from_target(head, model, layer=init == "layer")
    return head


def ttt_mask(m: int, step: int, device: torch.device) -> Tensor:
    """[m, (step + 1) * m] bool: step-0 keys causal, the keys of steps 1 .. step only on the row's own diagonal."""
    rows = torch.arange(m, device=device)
    causal = rows[None] <= rows[:, None]
    if step == 0:
        return causal
    eye = torch.eye(m, dtype=torch.bool, device=device)
    return torch.cat([causal, *[eye] * step], 1)


def target_to_draft(head: EagleHead) -> Tensor:
    """[vocab] int64: the draft id of each target id, -1 outside the draft vocabulary."""
    draft_ids = head.draft_to_target
    index = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
    return index.index_copy_(0, draft_ids, torch.arange(draft_ids.numel(), device=draft_ids.device))


def soft_cross_entropy(logprobs: Tensor, label_ids: Tensor, label_logprobs: Tensor, to_draft: Tensor
                       ) -> tuple[Tensor, Tensor]:
    """Per row, -sum_i p_i log q_i over the top-k label ids inside the draft vocabulary, p renormalised over them.
    logprobs [m, draft_vocab] (the head's), label_ids / label_logprobs [m, k], to_draft [vocab]. Returns the
    [m] losses and the [m] bool rows whose top label lies in the draft vocabulary (the rows to keep)."""
    draft = to_draft[label_ids]  # [m, k], -1 outside
    inside = draft >= 0
    weights = label_logprobs.masked_fill(~inside, -1e30).softmax(-1)  # finite even for rows with none inside
    cross = -(weights * logprobs.gather(1, draft.clamp(min=0))).sum(-1)
    return cross, inside[:, 0]


def ttt_loss(head: EagleHead, features: Features, ttt_steps: int, decay: float = 0.8,
             feature_weight: float = 1.0) -> tuple[Tensor, tuple[float, ...]]:
    """The training-time-test loss of one sequence (see the module docstring) and the top-1 agreement of each
    draft depth 1 .. ttt_steps (of the rows that have a label at that depth)."""
    tokens, n = features.tokens, features.tokens.numel()
    m = n - 1  # rows 0 .. n - 2
    device = head.fc.weight.device
    rows = torch.arange(m, device=device)
    draft_ids, to_draft = head.draft_to_target, target_to_draft(head)
    label_ids, label_logprobs = features.label_ids.to(device), features.label_logprobs.to(device)
    hidden = head.fuse(features.hidden[:m].to(device))
    keys: list[Tensor] = []
    values: list[Tensor] = []
    total = hidden.new_zeros(())
    agreements: list[float] = []
    for j in range(ttt_steps):
        label_rows = rows + 1 + j
        valid = label_rows <= n - 1
        if not bool(valid.any()):
            break
        label_rows = label_rows.clamp(max=n - 1)
        past = (torch.cat(keys, 1), torch.cat(values, 1)) if keys else None
        out, k, v = head.step(tokens[label_rows], hidden, rows + j, ttt_mask(m, j, device), past)
        keys.append(k)
        values.append(v)
        logits = head.draft_logits(out).float()  # [m, draft_vocab]
        best = label_ids[label_rows, 0]  # [m] the target's argmax
        cross, inside = soft_cross_entropy(logits.log_softmax(-1), label_ids[label_rows],
                                           label_logprobs[label_rows], to_draft)
        keep = valid & inside
        if bool(keep.any()):
            total = total + decay**j * cross[keep].mean()
        if head.config.arch == "eagle1" and feature_weight > 0:
            goal = features.hidden[label_rows].to(device, out.dtype)
            total = total + decay**j * feature_weight * nn.functional.smooth_l1_loss(out[valid], goal[valid])
        agreements.append(float((draft_ids[logits.argmax(-1)] == best)[valid].float().mean()))
        hidden = out
    return total, tuple(agreements)


def train_head(head: EagleHead, target: Target, sequences: Sequence[Tensor], steps: int, lr: float = 1e-3,
               generator: torch.Generator | None = None, ttt_steps: int = 3, batch_size: int = 1,
               decay: float = 0.8, feature_weight: float = 1.0, clip: float = 0.5,
               features: Sequence[Features] | None = None, anchor_offset: int = 0) -> TrainReport:
    """Train `head` in place for `steps` AdamW steps on `sequences` ([n] target ids each, n >= 2) of its target
    (LoadedModel, CachedModel or transformers model; `features`: already extracted ones instead). Each step
    averages `batch_size` sequences drawn with `generator`. The head is left in eval mode without gradients.
    anchor_offset: LongSpec heads (sparrow.heads.longspec) train at anchor-offset positions shifted by up to it."""
    if head.config.arch == "longspec":
        return train_longspec(head, _model(target), sequences, steps, lr, generator, anchor_offset=anchor_offset,
                              max_lag=ttt_steps + 1, clip=clip)
    if anchor_offset:
        raise ValueError("anchor_offset applies to LongSpec heads (arch='longspec') only")
    if steps < 1 or ttt_steps < 1 or batch_size < 1:
        raise ValueError(f"steps, ttt_steps and batch_size must be >= 1, got {steps}, {ttt_steps}, {batch_size}")
    start = time.perf_counter()
    data = list(features) if features is not None else extract_features(target, head.config.target_layers, sequences)
    assert data, "no training sequences"
    optimiser = new_optimiser(head, lr)
    losses, agreements, tokens = [], [], 0
    for _ in range(steps):
        result = train_step(head, optimiser, [data[i] for i in draw_batch(len(data), batch_size, generator)],
                            ttt_steps, decay, feature_weight, clip)
        losses.append(result.loss)
        agreements.append(result.agreement)
        tokens += result.tokens
    head.eval().requires_grad_(False)
    return TrainReport(tuple(losses), tuple(agreements), tokens, time.perf_counter() - start)


def train_step(head: EagleHead, optimiser: torch.optim.Optimizer, batch: Sequence[Features], ttt_steps: int,
               decay: float = 0.8, feature_weight: float = 1.0, clip: float = 0.5) -> StepResult:
    """One AdamW step on the mean TTT loss of `batch` (gradients clipped to norm `clip`)."""
    return mean_loss_step(head, optimiser, batch, lambda f: ttt_loss(head, f, ttt_steps, decay, feature_weight), clip)


@torch.no_grad()
def evaluate_head(head: EagleHead, features: Sequence[Features], ttt_steps: int = 3) -> Evaluation:
    """Loss and per-depth agreement of `head` on held-out `features` (the head is left in eval mode)."""
    head.eval()
    losses, agreements = [], []
    for f in features:
        loss, depths = ttt_loss(head, f, ttt_steps)
        losses.append(float(loss))
        agreements.append(depths)
    return Evaluation.mean_of(losses, agreements)


@torch.no_grad()
def evaluate(head: EagleHead, features: Sequence[Features], ttt_steps: int = 1) -> float:
    """Mean depth-1 top-1 agreement of `head` with the target on held-out `features`."""
    scores = [ttt_loss(head, f, ttt_steps)[1][0] for f in features]
    return sum(scores) / len(scores) if scores else 0.0
