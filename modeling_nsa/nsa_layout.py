"""Document layout of a packed batch, in static shapes (no host synchronization).

Everything NSA needs to know about documents and padding is one integer tensor:

    doc_pos (B, T): position of each token inside its document (0, 1, 2, ...), -1 for padding.

Two tokens s and t are in the same document iff both are valid and
``s - doc_pos[s] == t - doc_pos[t]`` (the same document start index). From ``doc_pos``
we derive the compressed-token layout: compressed token i of a document covers its raw keys
[i*d, i*d + l) (NSA_SPEC, Eq. 7) and is stored in a per-row slot list sorted by the index
of its last key (``cmp_end``); a row holds at most T // d of them whatever its documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class NSAParams:
    """The NSA hyper-parameters one attention call needs (paper symbols)."""

    cmp_block_size: int  # l
    cmp_stride: int  # d
    sel_block_size: int  # l'
    sel_num_blocks: int  # n
    sel_init_blocks: int
    sel_local_blocks: int
    window_size: int  # w

    @classmethod
    def from_config(cls, config) -> "NSAParams":
        return cls(
            cmp_block_size=config.cmp_block_size,
            cmp_stride=config.cmp_stride,
            sel_block_size=config.sel_block_size,
            sel_num_blocks=config.sel_num_blocks,
            sel_init_blocks=config.sel_init_blocks,
            sel_local_blocks=config.sel_local_blocks,
            window_size=config.window_size,
        )

    def num_cmp_slots(self, seq_len: int) -> int:
        """Static bound on compressed tokens in a row of `seq_len` tokens, any documents: T // d (>= 1)."""
        return max(1, seq_len // self.cmp_stride)


def document_positions(
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    batch_size: int,
    seq_len: int,
    device: torch.device,
) -> torch.Tensor:
    """Per-token position inside its document, -1 for padding. Returns (B, T) int64.

    A document starts at the row start, where `position_ids` is 0 (transformers' packed-sequence
    convention, as its flash-attention path reads it), and at the first valid token after padding.
    Other jumps in `position_ids` do not split a document, so a cache's later chunks (which see no
    earlier ids) apply the same rule: cached_document_positions.
    """
    no_past = torch.zeros(batch_size, dtype=torch.long, device=device)  # the row's first token starts a document
    return cached_document_positions(position_ids, attention_mask, no_past, batch_size, seq_len, device)


def cached_document_positions(
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    past_valid: torch.Tensor,
    batch_size: int,
    new_len: int,
    device,
) -> torch.Tensor:
    """doc_pos of `new_len` tokens appended to a cache whose last token has doc_pos `past_valid - 1` (B,)
    (0 where it was padding). Returns (B, new_len) int64, -1 at padding.

    The rules of document_positions over the whole row, applied to the new tokens only: each continues the
    row's last document unless its position id is 0 or it follows padding (`attention_mask` covers past +
    new tokens), so every chunking of a row gives the doc_pos of one forward over it (document_positions is
    this with no past).
    """
    index = torch.arange(new_len, device=device)
    valid = (
        torch.ones(batch_size, new_len, dtype=torch.bool, device=device)
        if attention_mask is None
        else attention_mask[:, -new_len:].to(device=device).bool()
    )
    is_start = torch.zeros(batch_size, new_len, dtype=torch.bool, device=device)
    if position_ids is not None:
        is_start |= position_ids[:, -new_len:].to(device).expand(batch_size, new_len) == 0
    is_start[:, 1:] |= ~valid[:, :-1]
    # start index of each token's document; -past_valid: the one the cache's last token is in
    continuing = (-past_valid.to(device=device, dtype=torch.long))[:, None].expand(batch_size, new_len)
    start_index = torch.where(is_start, index, continuing).cummax(dim=-1).values  # (B, new_len)
    doc_pos = index - start_index
    return torch.where(valid, doc_pos, torch.full_like(doc_pos, -1))


def ends_compressed_token(doc_pos: torch.Tensor, params: NSAParams) -> torch.Tensor:
    """True where a token is the last raw key of a compressed token: in-document position i*d + l - 1 (Eq. 7)."""
    block, stride = params.cmp_block_size, params.cmp_stride
    return (doc_pos >= block - 1) & ((doc_pos - (block - 1)) % stride == 0)


def compressed_token_ends(doc_pos: torch.Tensor, params: NSAParams, num_slots: int | None = None) -> torch.Tensor:
    """Index of the last raw key of each compressed token, per row. (B, T) -> (B, num_slots) int64, -1 = empty.

    Compressed token i of a document ends at in-document position i*d + l - 1 (Eq. 7); slots are
    filled in order of that index, so each document's tokens are a contiguous run of slots.
    """
    batch_size, seq_len = doc_pos.shape
    num_slots = params.num_cmp_slots(seq_len) if num_slots is None else num_slots
    emits = ends_compressed_token(doc_pos, params)  # (B, T)
    slot = emits.long().cumsum(-1) - 1
    slot = torch.where(emits, slot, torch.full_like(slot, num_slots))  # non-emitting tokens -> spare slot
    index = torch.arange(seq_len, device=doc_pos.device).expand(batch_size, seq_len)
    ends = torch.full((batch_size, num_slots + 1), -1, dtype=torch.long, device=doc_pos.device)
    ends.scatter_(1, slot.clamp(max=num_slots), torch.where(emits, index, torch.full_like(index, -1)))
    return ends[:, :num_slots]


def compression_block_index(cmp_end: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """The raw key index of the l keys each compressed token summarizes: cmp_end (B, N) -> (B, N * l), the keys
    (cmp_end - l, cmp_end] in order. Empty slots (cmp_end = -1) index the first l keys; callers zero their outputs."""
    offsets = torch.arange(block_size, device=cmp_end.device) - (block_size - 1)  # (l,)
    index = (cmp_end.clamp(min=block_size - 1)[:, :, None] + offsets).clamp(0, seq_len - 1)  # (B, N, l)
    return index.flatten(1)


def gather_compression_blocks(raw: torch.Tensor, block_index: torch.Tensor, block_size: int) -> torch.Tensor:
    """The l raw keys each compressed token summarizes. raw (B, T, Hkv, D), block_index (B, N * l)
    (compression_block_index) -> (B, N, l, Hkv, D)."""
    batch_size, _, num_kv_heads, head_dim = raw.shape
    flat = block_index[:, :, None, None].expand(-1, -1, num_kv_heads, head_dim)
    return raw.gather(1, flat).view(batch_size, -1, block_size, num_kv_heads, head_dim)


class CompressedLayout(NamedTuple):
    """Where a forward's compressed tokens sit, shared by every layer: a function of doc_pos and RoPE alone, so
    NSAModel builds it once per forward (as it builds RoPE's cos/sin) instead of once per layer (about 25 small
    launches per layer in a training step's forward). For a forward without cache and a static cache's prompt."""

    cmp_end: torch.Tensor  # (B, N) index of each compressed token's last raw key, -1: an empty slot
    block_index: torch.Tensor  # (B, N * l) the raw keys each covers (compression_block_index)
    keep: torch.Tensor  # (B, N) bool: the filled slots (empty ones are zeroed)
    cos: torch.Tensor  # (B, N, 1, D): each compressed key's RoPE, at its last raw key's position (Eq. 7)
    signed_sin: torch.Tensor  # (B, N, 1, D), apply_rope's signed sin


def compressed_layout(doc_pos: torch.Tensor, params: NSAParams, cos: torch.Tensor,
                      signed_sin: torch.Tensor) -> CompressedLayout:
    """doc_pos (B, T) and RoPE's cos/signed_sin (B, T, D) at every position -> the CompressedLayout of the row."""
    cmp_end = compressed_token_ends(doc_pos, params)  # (B, N)
    rope_index = cmp_end.clamp(min=0)[:, :, None].expand(-1, -1, cos.shape[-1])  # (empty slots: rotated anywhere)
    return CompressedLayout(
        cmp_end, compression_block_index(cmp_end, params.cmp_block_size, doc_pos.shape[1]), cmp_end >= 0,
        cos.gather(1, rope_index)[:, :, None], signed_sin.gather(1, rope_index)[:, :, None],
    )


def document_positions_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int, device) -> torch.Tensor:
    """doc_pos (1, T) for one flattened row of documents given by cumulative lengths [0, n1, n1+n2, ...]
    (flash-attention's varlen convention); tokens past cu_seqlens[-1] are padding (-1)."""
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.long)
    index = torch.arange(seq_len, device=device)
    doc = torch.searchsorted(cu_seqlens[1:], index, right=True).clamp(max=cu_seqlens.numel() - 2)
    doc_pos = index - cu_seqlens[doc]
    return torch.where(index < cu_seqlens[-1], doc_pos, torch.full_like(doc_pos, -1))[None]


def takes_flash_arguments(implementation: str) -> bool:
    """Whether transformers hands `implementation` flash attention's arguments (varlen lengths or a 2-D padding mask):
    as transformers decides it, by the mask function its mask interface holds for the name, or, for a name not (yet)
    registered there, by "flash" in the name (is_flash_attention_requested). Not only "flash_attention_*": where
    flash-attn is not installed but `kernels` is, "flash_attention_2" runs as the Hub kernel
    "kernels-community/flash-attn2", registered with flash's wrapper and mask."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    if implementation in ALL_MASK_ATTENTION_FUNCTIONS:
        return ALL_MASK_ATTENTION_FUNCTIONS[implementation] is flash_attention_mask
    return "flash" in implementation


def dense_attention_kwargs(implementation: str, doc_pos: torch.Tensor, num_queries: int, query_end=None,
                           single_document: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """The documents of doc_pos (B, Tk) as transformers' attention function `implementation` takes them (dense
    mode, causal attention inside documents), for queries at the last num_queries keys or (query_end (1,), a static
    cache's step) ending at key query_end[0]. Returns the function's keyword arguments; built once per forward.

    - "sdpa": a boolean mask (B, 1, Tq, Tk), none for one document per row (SDPA's causal kernels need none).
    - "eager": the same mask as additive scores (0 / the dtype's minimum).
    - "flex_attention": a BlockMask from the same rule (no (Tq x Tk) tensor on a GPU, where it is compiled).
    - "flash_attention_*" and Hub flash kernels (takes_flash_arguments): transformers' varlen path: every document
      of every row one sequence of the flattened batch, its lengths from doc_pos as position ids (each padding token
      a sequence of its own). After a cache: the keys of each row's last document, as a padding mask (a chunk that
      starts a document there is refused).
    Each padding query keeps its own key, so no softmax row is empty (its output is unused)."""
    batch, num_keys = doc_pos.shape
    flash = takes_flash_arguments(implementation)
    if single_document and (flash or implementation == "sdpa"):
        return {"attention_mask": None}  # plain causal attention
    key_index = torch.arange(num_keys, device=doc_pos.device)
    # document of each key, by its start index; padding keys each their own (negative) one
    doc_id = torch.where(doc_pos >= 0, key_index - doc_pos, -1 - key_index)  # (B, Tk)
    if flash and num_queries == num_keys and query_end is None:
        from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(doc_pos.clamp(min=0))
        return dict(attention_mask=None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=max_q,
                    max_length_k=max_k)
    if query_end is None:
        q_index = key_index[num_keys - num_queries :]
    else:
        q_index = query_end - num_queries + 1 + torch.arange(num_queries, device=doc_pos.device)
    if flash:
        query_docs = doc_id[:, q_index]  # (B, Tq)
        if num_queries > 1 and not torch.compiler.is_compiling() and bool((query_docs != query_docs[:, -1:]).any()):
            raise ValueError(f"attn_implementation={implementation!r} after a cache takes chunks inside one document "
                             "per row; this chunk starts a document. Use attn_implementation='sdpa' or 'flex_attention'.")
        return {"attention_mask": (doc_id == query_docs[:, -1:]).long()}  # (B, Tk) the keys of the last document
    if implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document_causal(b, h, q, kv):
            return (q_index[q] >= kv) & (doc_id[b, q_index[q]] == doc_id[b, kv])

        block_mask = create_block_mask(same_document_causal, batch, None, num_queries, num_keys,
                                       device=doc_pos.device, _compile=doc_pos.is_cuda)  # fmt: skip
        return {"attention_mask": block_mask}
    mask = (q_index[:, None] >= key_index) & (doc_id[:, q_index, None] == doc_id[:, None, :])  # (B, Tq, Tk)
    if implementation == "eager":
        return {"attention_mask": torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(dtype).min)[:, None]}  # fmt: skip
    return {"attention_mask": mask[:, None]}
