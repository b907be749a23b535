"""One target forward over a tree of drafts: the 4-D tree attention mask, per-node positions, and the target check.

transformers hands a 4-D `attention_mask` to the attention implementation unchanged (`masking_utils`: "already
prepared, or custom"): SDPA reads it as a boolean mask (True = attend), eager attention adds it (0 / dtype min). So a
tree is verified by any target loaded with `attn_implementation="sdpa"` or `"eager"` (or switched to `"sdpa_gqa"` by
`use_gqa_attention`, which takes SDPA's masks) that builds its masks through
`masking_utils` (Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3 and most decoder-only families of transformers 5). Flash,
flex and paged attention ignore such a mask or need their own format: `check_tree_attention` refuses them, and its
probe refuses a model that silently drops the mask, naming the model either way. A passed probe is remembered per
model object (while its attention implementation, dtype, device and `forward` stay the same), so repeated
`generate(..., tree_budget=N)` calls do not pay its two forwards again (on a 2-core CPU with SmolLM2-135M they cost
about 0.3 s, several percent of a short batch-1 call).
"""

from __future__ import annotations

import weakref

import torch
from transformers import PreTrainedModel

from .tree import DraftTree

__all__ = ["TREE_ATTENTION", "check_tree_attention", "tree_attention_mask", "verification_inputs"]

TREE_ATTENTION = ("sdpa", "eager", "sdpa_gqa")
"""Attention implementations that take a custom 4-D mask as given."""


def tree_attention_mask(tree: DraftTree, kv_valid: torch.Tensor, *, implementation: str = "sdpa",
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[R, 1, W, T + W]` mask of one tree verification forward (W = 1 + N: the anchor, then the nodes).

    Query row 0 (the anchor) and every node see the valid cached columns `kv_valid` `[R, T]` and the anchor; a node
    also sees its ancestors and itself. Padding rows see the cache and the anchor only (never an empty row, whose
    output would be NaN and reach the masked cache columns). Boolean (True = attend) for SDPA, additive float
    (0 / dtype min) for eager attention."""
    r, n = tree.tokens.shape
    w = 1 + n
    new = torch.zeros(r, w, w, dtype=torch.bool, device=tree.tokens.device)
    new[:, :, 0] = True
    new[:, 1:, 1:] = tree.ancestors()
    past = kv_valid.to(new.device).bool()[:, None, :].expand(r, w, -1)
    mask = torch.cat([past, new], dim=-1)[:, None]  # [R, 1, W, T + W]
    if implementation == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def verification_inputs(tree: DraftTree, anchors: torch.LongTensor, anchor_positions: torch.LongTensor,
                        kv_valid: torch.Tensor, *, implementation: str = "sdpa",
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per request: [anchor, node_1 .. node_N], padding slots filled with the anchor.

    Returns `input_ids` `[R, W]`, `position_ids` `[R, W]` (anchor position + depth; padding at the anchor's) and the
    4-D attention mask of `tree_attention_mask`."""
    device = anchors.device
    tokens = torch.where(tree.valid, tree.tokens.to(device), anchors[:, None])
    depths = torch.where(tree.valid, tree.depths.to(device), torch.zeros_like(tree.depths.to(device)))
    input_ids = torch.cat([anchors[:, None], tokens], dim=1)
    positions = anchor_positions[:, None] + torch.cat([torch.zeros_like(depths[:, :1]), depths], dim=1)
    mask = tree_attention_mask(tree, kv_valid, implementation=implementation, dtype=dtype)
    return input_ids, positions, mask.to(device)


_PROBED: "weakref.WeakKeyDictionary[PreTrainedModel, tuple]" = weakref.WeakKeyDictionary()
"""Models whose tree-mask probe passed, with what the probe depended on (ids only: no reference to the model)."""


def _probe_key(target: PreTrainedModel, impl: str) -> tuple:
    return (impl, str(target.dtype), str(target.device), id(type(target).forward), id(target.__dict__.get("forward")))


def _target_name(target: PreTrainedModel) -> str:
    return getattr(target.config, "_name_or_path", "") or type(target).__name__


@torch.no_grad()
def check_tree_attention(target: PreTrainedModel, probe: bool = True) -> str:
    """Refuses (ValueError naming the model) a target that cannot verify a tree in one forward; returns its attention
    implementation ("sdpa", "eager" or "sdpa_gqa").

    A tree needs a custom 4-D mask: transformers hands a 4-D mask to SDPA and eager attention as given, while flash /
    flex / paged attention ignore it or need their own mask format. With `probe`, two tiny forwards check that the
    mask is honoured: token c, a sibling of b (both children of a, at position 1), must get the logits of the plain
    sequence [a, c]. A model that passed is not probed again while its attention implementation, dtype, device and
    `forward` are unchanged."""
    name = _target_name(target)
    impl = getattr(target.config, "_attn_implementation", None) or "eager"
    if impl not in TREE_ATTENTION:
        raise ValueError(f"{name} runs attention with {impl!r}, which cannot take the custom 4-D tree attention mask "
                         f"that tree drafts need; load it with attn_implementation='sdpa' (or 'eager'), or decode "
                         f"chains (tree_budget=None)")
    if not probe:
        return impl
    try:
        if _PROBED.get(target) == _probe_key(target, impl):
            return impl
    except TypeError:  # not weakly referenceable: probe every time
        pass
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    a, b, c = 1 % vocab, 2 % vocab, 3 % vocab
    dtype = target.dtype
    visible = torch.tensor([[True, False, False], [True, True, False], [True, False, True]], device=device)
    mask = visible[None, None]
    if impl == "eager":
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    tree_logits = target(input_ids=torch.tensor([[a, b, c]], device=device), attention_mask=mask,
                         position_ids=torch.tensor([[0, 1, 1]], device=device), use_cache=False).logits[0, 2].float()
    plain = target(input_ids=torch.tensor([[a, c]], device=device), use_cache=False).logits[0, 1].float()
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    err = float((tree_logits - plain).abs().max()) / max(float(plain.abs().max()), 1e-6)
    if not err <= tol:
        raise ValueError(f"{name} does not honour a custom 4-D attention mask (a tree node's logits differ from its "
                         f"path's by {err:.2g} relative): it cannot verify tree drafts; decode chains "
                         f"(tree_budget=None)")
    try:
        _PROBED[target] = _probe_key(target, impl)
    except TypeError:
        pass
    return impl
