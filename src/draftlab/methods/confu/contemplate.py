"""Target-side rows of ConFu: soft prompts and contemplate tokens, their masks and positions.

Layout shared by inference and training (the target is frozen; only these rows' inputs are learned):

- The ``s`` soft prompts sit at the reserved positions ``0..s-1`` and attend only to each other
  (causally), never to the sequence. Their keys and values are therefore the same in every pass.
  They share those positions with the first prompt tokens, which is harmless: no normal row ever sees
  them, and the contemplate rows that do were trained under exactly this geometry.
- A contemplate row ``[con]`` attached to the token at position ``p`` sits at ``p + 1`` and attends to
  the sequence up to and including ``p`` (the committed prefix plus, in a verify pass, its node's
  ancestors and the node itself), to every soft prompt and to itself. Nothing attends to it.
- Its input embedding is ``ConFuDraft.contemplate_embedding`` of the target features of the last
  accepted token: ``p - lag`` with ``lag >= 1``, because a verify pass must know the embedding before
  it computes the features of its own tree nodes. At inference the lag of the contemplate row that is
  used (the last accepted node's) is the round's accept length; training samples it
  (``ConFuModule.max_con_lag``).

Because the soft prompts see nothing but each other, inference computes their keys and values once per
draft (``soft_prompt_kv``) and passes them as pinned keys (``targets.cache.PinnedKV``): a verify pass then
holds the tree and one contemplate row per node, not also ``s`` soft-prompt rows. Training runs them as
rows (``contemplate``), where their gradient is needed; the two layouts compute the same attention.
"""

from __future__ import annotations

import torch

from draftlab.decoding.drafter import ExtraRows
from draftlab.decoding.tree import ancestor_mask
from draftlab.targets.base import PassRequest
from draftlab.targets.cache import PinnedKV


@torch.no_grad()
def soft_prompt_kv(target, soft_prompts: torch.Tensor) -> PinnedKV:
    """The soft prompts' keys/values at every target layer (positions ``0..s-1``, causal among themselves)."""
    s = soft_prompts.shape[0]
    cache = target.new_cache(1, s)
    no_logits = torch.arange(0, device=target.device)
    target.forward(None, torch.arange(s, device=target.device), cache,
                   request=PassRequest(input_embeds=soft_prompts[None], logits_rows=no_logits))
    cache.commit(s)
    return PinnedKV.capture(cache)


def verify_extra_rows(soft_prompts: torch.Tensor | PinnedKV, con_embed: torch.Tensor, parents: torch.Tensor,
                      depth: torch.Tensor, past: int) -> ExtraRows:
    """Soft prompts plus one contemplate row per node of an N-node tree (the engine's ``extra_rows``).

    soft_prompts [s, d] (rows of the pass) or their ``PinnedKV`` (``soft_prompt_kv``: keys computed once);
    con_embed [d] (one embedding for every contemplate row of the pass); parents/depth [N] of the tree;
    past = committed target length. Rows: ``s`` soft prompts (none when pinned), then the contemplate row
    of node i at extra index ``s + i`` (verify-pass row ``N + s + i``).
    """
    n = parents.shape[0]
    if isinstance(soft_prompts, PinnedKV):
        # Contemplate rows only: node ancestors + self; the pinned soft prompts are seen by all of them.
        tree_mask = torch.zeros(n, 2 * n, dtype=torch.bool)  # [N, N + N]
        tree_mask[:, :n] = ancestor_mask(parents.cpu())
        tree_mask[:, n:] = torch.eye(n, dtype=torch.bool)
        embeds = con_embed[None].expand(n, -1)  # [N, d]
        return ExtraRows(embeds=embeds, tree_mask=tree_mask, position_ids=past + depth.cpu() + 1,
                         pinned=soft_prompts)
    s = soft_prompts.shape[0]
    r = s + n
    tree_mask = torch.zeros(r, n + r, dtype=torch.bool)  # [R, N + R]
    tree_mask[:s, n:n + s] = torch.ones(s, s, dtype=torch.bool).tril()
    tree_mask[s:, :n] = ancestor_mask(parents.cpu())
    tree_mask[s:, n:n + s] = True
    tree_mask[s:, n + s:] = torch.eye(n, dtype=torch.bool)
    positions = torch.cat([torch.arange(s), past + depth.cpu() + 1])  # [R]
    sees_prefix = torch.cat([torch.zeros(s, dtype=torch.bool), torch.ones(n, dtype=torch.bool)])  # [R]
    embeds = torch.cat([soft_prompts, con_embed.to(soft_prompts).expand(n, -1)])  # [R, d]
    return ExtraRows(embeds=embeds, tree_mask=tree_mask, position_ids=positions, sees_prefix=sees_prefix)


def contemplate(target, cache, soft_prompts: torch.Tensor | PinnedKV, con_embed: torch.Tensor,
                anchors: torch.Tensor, *, aux_layer_ids: list[int] | None = None) -> torch.Tensor:
    """Tapped target states ``[B, K, 3*d_t]`` of contemplate rows attached to committed positions.

    cache       the target cache holding the sequences' committed keys/values (read, never written).
    soft_prompts [s, d_t]; con_embed [B, K, d_t]; anchors [B, K] target positions (-1 = unused slot).
    Runs ``s + K`` rows per sequence through ``target.forward_with_grad``: under grad mode, gradients
    reach ``soft_prompts`` and ``con_embed`` (through the frozen target) and nothing else, since the
    cached prefix is constant. Contemplate rows do not see each other. ``aux_layer_ids``: the taps to
    read (target's convention; the draft's ``taps``); None = the target's default taps.
    ``soft_prompts`` may be their ``PinnedKV`` (inference: no gradient, keys computed once).
    """
    if isinstance(soft_prompts, PinnedKV):
        return _contemplate_pinned(target, cache, soft_prompts, con_embed, anchors, aux_layer_ids)
    B, K = anchors.shape
    s, T = soft_prompts.shape[0], cache.length
    dev = con_embed.device
    valid = anchors >= 0  # [B, K]
    a = anchors.clamp(min=0)
    mask = torch.zeros(B, s + K, T + s + K, dtype=torch.bool, device=dev)  # [B, R, S]
    mask[:, :s, T:T + s] = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    mask[:, s:, :T] = (torch.arange(T, device=dev) <= a[..., None]) & valid[..., None]
    mask[:, s:, T:T + s] = valid[..., None]
    mask[:, s:, T + s:] = torch.eye(K, dtype=torch.bool, device=dev)
    positions = torch.cat([torch.arange(s, device=dev).expand(B, s), a + 1], dim=1)  # [B, R]
    embeds = torch.cat([soft_prompts.expand(B, -1, -1).to(con_embed), con_embed], dim=1)  # [B, R, d_t]
    request = PassRequest(input_embeds=embeds, aux=True if aux_layer_ids is None else aux_layer_ids,
                          logits_rows=torch.arange(0, device=dev))
    out = target.forward_with_grad(None, positions, cache, mask, request)
    return out.aux_hidden[:, s:]  # [B, K, 3*d_t]


def _contemplate_pinned(target, cache, pinned: PinnedKV, con_embed: torch.Tensor, anchors: torch.Tensor,
                        aux_layer_ids: list[int] | None) -> torch.Tensor:
    # ``contemplate`` with the soft prompts as pinned keys: K rows, each seeing its prefix, the soft prompts
    # and itself.
    B, K = anchors.shape
    T, dev = cache.length, con_embed.device
    valid = anchors >= 0  # [B, K]
    a = anchors.clamp(min=0)
    mask = torch.zeros(B, K, T + K, dtype=torch.bool, device=dev)  # [B, K, S]
    mask[:, :, :T] = (torch.arange(T, device=dev) <= a[..., None]) & valid[..., None]
    mask[:, :, T:] = torch.eye(K, dtype=torch.bool, device=dev)
    pmask = valid[..., None].expand(B, K, pinned.num_rows)  # [B, K, s]
    request = PassRequest(input_embeds=con_embed, aux=True if aux_layer_ids is None else aux_layer_ids,
                          logits_rows=torch.arange(0, device=dev), pinned=pinned, pinned_mask=pmask)
    out = target.forward_with_grad(None, a + 1, cache, mask, request)
    return out.aux_hidden  # [B, K, 3*d_t]
