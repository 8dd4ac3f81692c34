"""Lossless rejection sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023), for chains and trees.

p: target distribution, q: draft distribution, both over the target vocabulary and both
   after the same temperature / top-k / top-p (`sparrow.sampling.probs`).
accepted token: draft token x kept with probability min(1, p(x) / q(x)).
recovered token: sampled from norm(max(0, p - q)) at the first rejection.
bonus token: sampled from p after the last draft position when every draft is accepted.

Deterministic drafts (argmax, top-k tree children, n-gram, re-tokenised text; `Draft.probs is None`)
use the q = 1 rule: the proposal is a point mass on x, so x is accepted with probability p(x) and
the residual is p with x removed, renormalised. Using the draft's softmax as q for such drafts is
*not* lossless (p(x)=0.3, q(x)=0.6 would emit x with probability 0.5).

Trees (multi-candidate, SpecInfer / EAGLE-2 style): walk down from the root. At each node try its
children in index order against the current p; accepting child x moves to x (p becomes the target's
distribution at x's row); rejecting it replaces p by the residual norm(max(p - q, 0)) before the
next sibling is tried. When every child is rejected, the recovered token is sampled from the residual
left; at a leaf, the bonus token is sampled from p.

Why the q = 1 rule is lossless over several distinct siblings x_1..x_m: the walk is sequential
inverse-CDF sampling, i.e. sampling from p without replacement. After x_1..x_{j-1} were rejected,
p has been renormalised to p(.) / (1 - p(x_1) - ... - p(x_{j-1})) off the rejected tokens, so

    P(emit x_j) = (1 - sum_{i<j} p(x_i)) * p(x_j) / (1 - sum_{i<j} p(x_i)) = p(x_j),

and with probability 1 - sum_i p(x_i) every sibling is rejected and the recovered token is drawn from
p restricted to the other tokens, emitting each such y with probability p(y). Conditional on the
earlier siblings being rejected, the next sibling's "proposal probability" is 1 (it is fixed), which
is the EAGLE maintainers' answer (SafeAILab/EAGLE#93). A duplicate sibling is harmless: its token
was zeroed by the first copy's rejection, so it has p(x) = 0 and is never accepted, and zeroing it
again leaves the residual unchanged. For siblings sampled i.i.d. from q (probs given) the same
induction applies to the one-step rule: a draw from q accepted with min(1, r/q), else a draw from
norm(max(r - q, 0)), has law r for any r, and the next i.i.d. sibling is independent of the rejection,
so trying it against the residual produces the residual's law (SpecInfer, Miao et al. 2024, Thm. 4.2).
Given the emitted token x, an accepted node's subtree depends only on x, so the next token follows
p(. | x) in turn.

At temperature 0 both p and q are one-hot, and the rules reduce to greedy matching.

Seeded requests (`sparrow.noise.PositionalNoise`) use coupled verification instead, so that their output
does not depend on how the tokens were chunked into rounds: greedy matching against the target's own
sample at each row, drawn with the noise of the row's position (`verify_coupled`; lossless, and equal
to seeded plain decoding; see `sparrow.noise` for why and for its acceptance rate).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparrow import sampling as S
from sparrow import tree
from sparrow.config import SamplingConfig
from sparrow.noise import PositionalNoise, Randomness
from sparrow.types import Draft, Verdict
from sparrow.verifiers import greedy


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) for [vocab] rows; falls back to p when p == q leaves no mass (no host sync)."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total, p)


def point_mass(x: Tensor, p: Tensor) -> Tensor:
    """[vocab] the q = 1 proposal of a deterministic draft token x (a 0-dim tensor), shaped like p."""
    return torch.zeros_like(p).scatter_(-1, x.reshape(1), 1.0)


def accepts(u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    """[...] bool: keep x when u < min(1, p(x) / q(x)), in float64; never when q(x) = 0."""
    return (q_x > 0) & (u < (p_x.double() / q_x.double()).clamp_max(1.0))


class RejectionVerifier:
    name = "rejection"

    def verify(
        self,
        draft: Draft,
        target_logits: Tensor,  # [n + 1, vocab]: row 0 scores the root, row i + 1 scores node i
        sampling: SamplingConfig,
        generator: Randomness,  # positional noise: offset 0 is the position of the first draft token
    ) -> Verdict:
        n = len(draft)
        assert target_logits.ndim == 2 and target_logits.shape[0] == n + 1, (tuple(target_logits.shape), n)
        p = S.probs(target_logits, sampling)  # [n + 1, vocab]
        tokens = draft.tokens.to(p.device)  # [n]
        if isinstance(generator, PositionalNoise):
            return verify_coupled(tokens, draft.parents, p, generator)
        q = None if draft.probs is None else draft.probs.to(p.device).float()  # [n, vocab] or None (q = 1)
        if draft.parents is None:
            return verify_chain(tokens, q, p, generator)
        return verify_tree(tokens, draft.parents, q, p, generator)


def verify_coupled(tokens: Tensor, parents: Tensor | None, p: Tensor, noise: PositionalNoise) -> Verdict:
    """tokens, parents: [n] chain (parents None) or tree; p: [n + 1, vocab]. Row r (the root, or node r - 1)
    predicts the token at offset depth(r) from the first draft position; the target samples it with that
    position's noise, and the draft is greedily matched against these samples. q is not needed."""
    depth = list(range(tokens.numel() + 1)) if parents is None else [0, *tree.depths(parents).tolist()]
    choice = S.sample(p, noise, depth)  # [n + 1]: the target's own token after each row
    if parents is None:
        return greedy.verify_chain(tokens, choice)
    return greedy.verify_tree(tokens, parents.to(p.device), choice)


def verify_chain(tokens: Tensor, q: Tensor | None, p: Tensor, generator: torch.Generator | None) -> Verdict:
    """tokens: [k] chain; q: [k, vocab] or None (q = 1 rule); p: [k + 1, vocab]. One host sync."""
    k = tokens.numel()
    p_x = p[:k].gather(1, tokens[:, None])[:, 0]  # [k]
    q_x = torch.ones_like(p_x) if q is None else q.gather(1, tokens[:, None])[:, 0]  # [k]
    u = S.uniform(k, p.device, generator)  # [k] float64
    num_accepted = int(accepts(u, p_x, q_x).cumprod(0).sum())  # the first rejection ends the chain
    if num_accepted < k:  # recovered token from the residual of the first rejected position only
        x = tokens[num_accepted]
        q_row = point_mass(x, p[num_accepted]) if q is None else q[num_accepted]
        last = S.sample(residual(p[num_accepted], q_row), generator)
    else:  # every draft accepted: bonus token from p after the last one
        last = S.sample(p[k], generator)
    return Verdict(tokens=torch.cat([tokens[:num_accepted], last.reshape(1)]), num_accepted=num_accepted)


def try_children(children: list[int], tokens: Tensor, q: Tensor | None, target: Tensor,
                 u: Tensor) -> tuple[int | None, Tensor]:
    """Try sibling nodes `children` in order against `target` ([vocab], p at their parent's row).

    Returns (the accepted child, or None when all are rejected; the distribution left: `target`, or
    the residual after the rejected siblings). tokens: [n]; u: [n] float64, one uniform per node.
    One host sync per sibling tried.
    """
    for child in children:
        x = tokens[child : child + 1]  # [1]
        q_row = point_mass(x, target) if q is None else q[child]  # [vocab]
        if bool(accepts(u[child], target.gather(0, x), q_row.gather(0, x))):
            return child, target
        target = residual(target, q_row)
    return None, target


def verify_tree(tokens: Tensor, parents: Tensor, q: Tensor | None, p: Tensor,
                generator: torch.Generator | None) -> Verdict:
    """tokens, parents: [n] tree; q: [n, vocab] or None (q = 1 rule); p: [n + 1, vocab]."""
    kids = tree.children(parents)  # [n + 1] child lists; entry 0 is the root's, entry i + 1 node i's
    u = S.uniform(tokens.numel(), p.device, generator)  # [n]: each node is tried at most once
    path: list[int] = []
    node, target = -1, p[0]
    while True:
        child, target = try_children(kids[node + 1], tokens, q, target, u)
        if child is None:  # every child rejected: recovered token; no children: bonus token
            break
        path.append(child)
        node, target = child, p[child + 1]
    last = S.sample(target, generator)
    nodes = torch.tensor(path, dtype=torch.long, device=p.device)  # [num_accepted], root to leaf
    return Verdict(tokens=torch.cat([tokens[nodes], last.reshape(1)]), num_accepted=len(path), path=nodes)
