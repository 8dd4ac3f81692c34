"""Lossless rejection sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

p: target distribution, q: draft distribution, both over the target vocabulary and both
   after the same temperature / top-k / top-p (`sparrow.sampling.probs`).
accepted token: draft token x kept with probability min(1, p(x) / q(x)).
recovered token: sampled from norm(max(0, p - q)) at the first rejection.
bonus token: sampled from p after the last draft position when every draft is accepted.

Deterministic drafts (argmax, n-gram, re-tokenised text; `Draft.probs is None`) use the
q = 1 rule: the proposal is a point mass on x, so x is accepted with probability p(x) and
the residual is p with x removed, renormalised. Using the draft's softmax as q for such
drafts is *not* lossless (p(x)=0.3, q(x)=0.6 would emit x with probability 0.5).

At temperature 0 both p and q are one-hot, and the rules reduce to greedy matching.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.types import Draft, Verdict


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) for [vocab] rows; falls back to p when p == q leaves no mass."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


class RejectionVerifier:
    name = "rejection"

    def verify(
        self,
        draft: Draft,
        target_logits: Tensor,  # [k + 1, vocab]
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Verdict:
        k = len(draft)
        assert target_logits.ndim == 2 and target_logits.shape[0] == k + 1, (tuple(target_logits.shape), k)
        p = S.probs(target_logits, sampling)  # [k + 1, vocab]
        tokens = draft.tokens.tolist()
        u = S.uniform(k, p.device, generator).tolist()
        for i, x in enumerate(tokens):
            if draft.probs is None:  # point-mass proposal: q(x) = 1
                q = torch.zeros_like(p[i])
                q[x] = 1.0
            else:
                q = draft.probs[i].float()
            p_x, q_x = float(p[i, x]), float(q[x])
            if q_x > 0 and u[i] < min(1.0, p_x / q_x):
                continue
            recovered = S.sample(residual(p[i], q), generator)
            return Verdict(tokens=torch.tensor([*tokens[:i], int(recovered)], device=p.device), num_accepted=i)
        bonus = S.sample(p[k], generator)
        return Verdict(tokens=torch.tensor([*tokens, int(bonus)], device=p.device), num_accepted=k)
