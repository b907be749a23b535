"""DSpark training losses (paper section 3.3): pure tensor functions.

For N supervised blocks of K slots, with position weights w_k = exp(-(k - 1) / gamma) (k = 1..K):

* CE   = cross-entropy of the Markov-corrected draft logits against the ground-truth token,
* TV   = sum_v |p_d(v) - p_t(v)| over the full vocabulary (fp32), p_t = softmax of the target's own logits,
* conf = BCE(confidence logit, c*) with c* = 1 - 0.5 * ||p_d - p_t||_1, detached (the analytic acceptance rate),

each averaged over the supervised slots with weights w_k, combined as alpha_ce * CE + alpha_tv * TV +
alpha_conf * conf (paper: 0.1, 0.9, 1.0). The DFlash baseline uses CE only (alpha_tv = alpha_conf = 0).
Diagnostics: accept_rate@k (mean c* at slot k) and the expected accepted length 1 + sum_j prod_{i<=j} c*_i.

Reduced draft vocabulary (`draft_vocab` = the drafter's `d2t`, Vd sorted target ids): the draft logits are `[N, K, Vd]`
over the draft ids, p_d is zero outside them, the target logits stay full-vocabulary `[N, K, V]`. Then

* TV   = sum_{draft ids} |p_d - p_t| + (target mass outside the draft vocabulary), the exact ||p_d - p_t||_1 over the
         full vocabulary; p_t on the draft ids is exp(z_t[d2t] - logsumexp_V z_t) and the outside mass is
         1 - exp(logsumexp_{d2t} z_t - logsumexp_V z_t), so no [N, K, V] softmax or difference is formed,
* c*   = 1 - 0.5 * TV as before (the outside mass can never be accepted),
* CE   is masked where the label lies outside the draft vocabulary (the drafter cannot propose it; its TV and c* terms
         stay, they carry the lost mass), with its own normaliser (the weighted count of in-vocabulary slots), and
* every slot *after* an out-of-vocabulary label is dropped from all terms: its teacher-forced prefix contains a token
  the drafter never drafts, a state verification never reaches.

Sparse teacher (`target_topk`, `teacher.TeacherTopK`): only the target's k most probable draft ids per position and
their exact probabilities p_t(j) (normalised over the full vocabulary) are given, cached once per example instead of
a `[N, K, Vd]` product of the target's LM head every step. With P_d = sum_{j in top k} p_d(j) and r = 1 -
sum_{j in top k} p_t(j) (the teacher's mass on its other draft ids and outside the draft vocabulary),

* TV   = sum_{j in top k} |p_d(j) - p_t(j)| + (1 - P_d) + r, an upper bound of the exact ||p_d - p_t||_1 (the triangle
         inequality on the other tokens), equal to it where the teacher puts no mass on draft ids outside its top k;
         the gradient is the exact one's with the teacher's mass beyond its top k treated as zero,
* c*   = 1 - 0.5 * TV, so a lower bound of the exact acceptance rate, short by at most r (the confidence head learns
         slightly conservative survival; STS calibration corrects the scale after training).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["LossOutput", "LossWeights", "dspark_loss", "position_weights"]


@dataclass
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    decay: float = 7.0  # gamma of w_k = exp(-(k - 1) / gamma)


@dataclass
class LossOutput:
    """Loss terms (scalars) and diagnostics of one batch."""

    total: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    conf: torch.Tensor
    accept_rate: torch.Tensor  # [K] mean c* per slot over supervised blocks
    expected_tau: torch.Tensor  # scalar: mean over blocks of 1 + sum_j prod_{i<=j} c*_i (supervised prefix)
    num_slots: int

    def as_dict(self) -> dict[str, float]:
        scalar = lambda x: float(x.detach())  # noqa: E731
        out = {"loss": scalar(self.total), "ce": scalar(self.ce), "tv": scalar(self.tv), "conf": scalar(self.conf),
               "expected_tau": float(self.expected_tau), "supervised_slots": self.num_slots}
        out.update({f"accept_rate@{k + 1}": float(v) for k, v in enumerate(self.accept_rate)})
        return out


def position_weights(block_size: int, decay: float, device: torch.device | None = None) -> torch.Tensor:
    """w_k = exp(-(k - 1) / decay) for k = 1..K."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / decay)


def dspark_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor | None,
    labels: torch.Tensor,
    mask: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    weights: LossWeights,
    draft_vocab: torch.Tensor | None = None,
    target_lse: torch.Tensor | None = None,
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> LossOutput:
    """The three DSpark terms.

    Args:
        draft_logits: `[N, K, V]` Markov-corrected draft logits (teacher-forced).
        target_logits: `[N, K, V]` the target's logits for the same positions (no gradient); None with `target_topk`.
        labels: `[N, K]` ground-truth tokens.
        mask: `[N, K]` bool, supervised slots (cumulative-product mask).
        confidence_logits: `[N, K]` or None (no confidence head).
        weights: loss weights and position decay.
        draft_vocab: `[Vd]` sorted target ids of a reduced draft vocabulary (the drafter's `d2t`); then
            `draft_logits` is `[N, K, Vd]` (draft ids) while `target_logits` and `labels` stay in target ids.
        target_lse: `[N, K]` the target's log-normalizer over its full vocabulary (`teacher.TeacherNormalizer`);
            then `target_logits` holds only the draft vocabulary's logits `[N, K, Vd]` (in draft-id order) and the
            teacher distribution is still exact: p_t = exp(z - lse) inside, 1 - sum(p_t) outside.
        target_topk: `(ids [N, K, k], logp [N, K, k])` the sparse teacher: the target's k most probable *draft* ids
            (indices into `draft_vocab`) and their log-probabilities over its full vocabulary; then `target_logits`
            must be None and TV / c* use the upper bound of the module docstring.
    """
    n, k, _ = draft_logits.shape
    device = draft_logits.device
    mask = mask.bool()
    labels = labels.clamp(min=0)
    ce_mask = mask
    if draft_vocab is not None:
        d2t = draft_vocab.to(device)
        index = torch.searchsorted(d2t, labels.contiguous()).clamp(max=d2t.shape[0] - 1)
        in_vocab = d2t[index] == labels
        labels = index  # draft ids (meaningless where not in_vocab: masked)
        reachable = torch.cat([torch.ones_like(in_vocab[:, :1]), in_vocab[:, :-1]], dim=1).long().cumprod(dim=1)
        mask = mask & reachable.bool()
        ce_mask = mask & in_vocab
    if target_lse is not None and draft_vocab is None:
        raise ValueError("target_lse is for a reduced draft vocabulary (draft_vocab); without one pass full logits")
    if (target_topk is None) == (target_logits is None):
        raise ValueError("pass exactly one teacher: target_logits (dense) or target_topk (sparse)")
    if target_topk is not None:
        if draft_vocab is None:
            raise ValueError("target_topk holds draft ids: it needs the reduced draft vocabulary (draft_vocab)")
        if target_topk[0].shape != target_topk[1].shape or target_topk[0].shape[:2] != (n, k):
            raise ValueError(f"target_topk must be two [N, K, k] tensors with N, K = {n}, {k}; got "
                             f"{tuple(target_topk[0].shape)} and {tuple(target_topk[1].shape)}")
    pos_w = position_weights(k, weights.decay, device)[None, :].expand(n, k)
    w = pos_w * mask
    w_ce = pos_w * ce_mask
    denom = w.sum().clamp(min=1e-8)
    logp_d = F.log_softmax(draft_logits.float(), dim=-1)
    # TV's gradient is needed only where it is weighted (DFlash, alpha_tv = 0, reads it as a diagnostic; c* is
    # detached anyway), and the sparse teacher needs p_d on its top-k ids only, not the whole [N, K, V] softmax
    logp_tv = logp_d if weights.tv != 0 else logp_d.detach()
    with torch.no_grad():
        z_t = None if target_logits is None else target_logits.float()
        if target_topk is not None:
            topk_ids = target_topk[0].to(device).long()
            p_top = target_topk[1].to(device).float().exp()  # [N, K, k]
            residual = (1.0 - p_top.sum(dim=-1)).clamp(min=0.0)  # [N, K]: the teacher's mass beyond its top k
        elif draft_vocab is None:
            p_t, outside = F.softmax(z_t, dim=-1), 0.0
        elif target_lse is not None:
            if z_t.shape[-1] != d2t.shape[0] or target_lse.shape != z_t.shape[:2]:
                raise ValueError(f"with target_lse, target_logits must be the draft vocabulary's [N, K, "
                                 f"{d2t.shape[0]}] and target_lse [N, K]; got {tuple(z_t.shape)} and "
                                 f"{tuple(target_lse.shape)}")
            lse, z_in = target_lse.float()[..., None], z_t
        else:
            lse = torch.logsumexp(z_t, dim=-1, keepdim=True)  # [N, K, 1] over the full vocabulary
            z_in = z_t.index_select(-1, d2t)  # [N, K, Vd]
        if draft_vocab is not None and target_topk is None:
            p_t = torch.exp(z_in - lse)
            outside = (-torch.expm1(torch.logsumexp(z_in, dim=-1) - lse.squeeze(-1))).clamp(min=0.0)  # [N, K]
    ce_pos = F.nll_loss(logp_d.reshape(n * k, -1), labels.reshape(-1), reduction="none").view(n, k)
    if target_topk is not None:
        p_d_top = logp_tv.gather(-1, topk_ids).exp()  # [N, K, k]
        l1_pos = (p_d_top - p_top).abs().sum(dim=-1) + (1.0 - p_d_top.sum(dim=-1)) + residual
    else:
        l1_pos = (logp_tv.exp() - p_t).abs().sum(dim=-1) + outside  # [N, K], in [0, 2]
    ce = (ce_pos * w_ce).sum() / w_ce.sum().clamp(min=1e-8)
    tv = (l1_pos * w).sum() / denom
    c_star = (1.0 - 0.5 * l1_pos).detach().clamp(0.0, 1.0)
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), c_star, reduction="none")
        conf = (bce * w).sum() / denom
    else:
        conf = torch.zeros((), device=draft_logits.device)
    total = weights.ce * ce + weights.tv * tv + weights.conf * conf
    with torch.no_grad():
        counts = mask.sum(dim=0).clamp(min=1)
        accept_rate = (c_star * mask).sum(dim=0) / counts
        survival = torch.cumprod(torch.where(mask, c_star, torch.zeros_like(c_star)), dim=1)
        blocks = mask[:, 0]
        expected_tau = (1.0 + survival.sum(dim=1))[blocks].mean() if blocks.any() else torch.tensor(math.nan)
    return LossOutput(total=total, ce=ce, tv=tv, conf=conf, accept_rate=accept_rate, expected_tau=expected_tau,
                      num_slots=int(mask.sum()))
