"""NSA's generation cache: NSACache (a transformers Cache) with one NSALayerCache per layer (growing buffers) or,
static=True, one NSAStaticLayerCache per layer (fixed-size buffers a compiled decoding step writes in place).

As Llama's attention calls `past_key_values.update(k, v, layer_idx)`, NSA's calls `NSACache.update(...)` once per
layer and step: the layer cache stores what the step computed (selection, window and raw keys, and the compressed
tokens the step completes) and returns what the three branches read (`BranchKeys`). The compressed tokens are made
by a function the attention passes in (its compressor module and RoPE: the math stays in the model).

Imports only torch, transformers and flat siblings (it travels with checkpoints as remote code; no triton).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from transformers.cache_utils import Cache

from .configuration_nsa import NSAConfig
from .nsa_layout import (
    CompressedLayout,
    NSAParams,
    cached_document_positions,
    compressed_token_ends,
    document_positions,
    ends_compressed_token,
)

# compress(k, v, cmp_end=None, keep=None, key_index=None, compressed=None) -> k_cmp, v_cmp (B, N, Hkv, D), k rotated
# (NSAAttention._compress): from raw keys/values (B, T, Hkv, D) and cmp_end (B, N) indexing them (or the forward's
# CompressedLayout), or from gathered blocks (B, N, l, Hkv, D) and keep (B, N); key_index (B, N): the key position of
# each token's last key (its RoPE position), None: the step's last query position (a decoding step's one block).
Compress = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]


class BranchKeys(NamedTuple):
    """What one attention step reads (NSA_SPEC; the arguments of nsa_attention / dense attention).

    k_slc/v_slc (B, Tk, Hkv, D): every key (selection, or dense attention), rotated.
    k_win/v_win: the sliding window's keys (the last ones, or a static cache's ring); None in dense mode.
    k_cmp/v_cmp (B, Nc, Hkv, D), cmp_end (B, Nc): the compressed tokens and each one's last key index (-1: empty
    slot); None in dense mode.
    query_end (1,): a static cache's step, whose queries end at this key index; None: the queries are the last keys.
    """

    k_slc: torch.Tensor
    v_slc: torch.Tensor
    k_win: torch.Tensor | None = None
    v_win: torch.Tensor | None = None
    k_cmp: torch.Tensor | None = None
    v_cmp: torch.Tensor | None = None
    cmp_end: torch.Tensor | None = None
    query_end: torch.Tensor | None = None


class TokenStep(NamedTuple):
    """Where a one-token decoding step's state goes, the same in every layer (a function of doc_pos and, in a static
    cache, the cursor): NSACache works it out once per step (append_positions) and every layer cache reads it,
    where each layer worked it out again (eager decoding dispatches each op of each layer at every token).

    emits (B, 1) bool: the token completes a compressed token (in-document position i*d + l - 1, Eq. 7).
    end (B, 1): its key index where it does, -1 where not (the new compressed token's cmp_end entry).
    Static cache only (None otherwise), rings indexed by key position: tail_slot and window_slot (1,), the token's
    slot in the raw tail (p % l) and the window (p % w); tail_order (l,), the tail's slots in key order, ending at
    the token's.
    compresses: False when no row can complete a compressed token at this step (known on the host from the step
    before: NSACache.no_row_can_emit); the layers then skip the compressor and the compressed caches' writes, and
    emits and end are None. True otherwise (emits decides per row on the device).
    """

    emits: torch.Tensor | None
    end: torch.Tensor | None
    tail_slot: torch.Tensor | None = None
    window_slot: torch.Tensor | None = None
    tail_order: torch.Tensor | None = None
    compresses: bool = True

    def on(self, device: torch.device) -> "TokenStep":
        """This step on a layer's device: itself where it is there already. A model split over GPUs (device_map)
        gets each layer's arguments moved to the layer's GPU, but not the cache, which holds the step."""
        if self.emits is None or self.emits.device == device:  # (None: a step that compresses nothing)
            return self
        return TokenStep(*(value.to(device) if isinstance(value, torch.Tensor) else value for value in self))


def is_eager_step(tensor: torch.Tensor) -> bool:
    """Whether the step holding `tensor` runs eagerly: neither compiled nor being captured into a CUDA graph, which
    must not read a device value on the host (a graph break, or a recompile per token) nor branch on one."""
    return not torch.compiler.is_compiling() and not (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


def runs_in_lockstep_with_other_ranks() -> bool:
    """Whether this process runs the model together with others (torch.distributed, more than one rank). Sharded
    weights (DeepSpeed ZeRO-3, FSDP units smaller than a layer) are gathered as each module runs, so every rank must
    run the same modules at every step: a step may not skip one on its own rows' account."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1


def sequence_keys(key_states, value_states, k_win=None, v_win=None, k_raw=None, v_raw=None,
                  compress: Compress | None = None, compressed: CompressedLayout | None = None) -> BranchKeys:
    """What a step with no cache before it reads (a forward without cache, a static cache's prompt): its own keys
    and every compressed token of its documents. Arguments as NSACache.update; k_raw None: dense attention;
    compressed: the layout of the compressed tokens (nsa_layout.compressed_layout; NSAModel builds it once per
    forward), needed with k_raw."""
    if k_raw is None:
        return BranchKeys(key_states, value_states)
    cmp_end = compressed.cmp_end  # (B, Nc)
    k_cmp, v_cmp = compress(k_raw, v_raw, compressed=compressed)
    if k_win is None:  # the window shares the selection's K/V set: it reads the selection keys
        k_win, v_win = key_states, value_states
    return BranchKeys(key_states, value_states, k_win, v_win, k_cmp, v_cmp, cmp_end)


class TokenBuffer:
    """A (B, n, ...) tensor grown along dim 1 in place. Appending m tokens writes m tokens: the storage keeps
    spare room, and only a full storage is copied, into one a quarter larger (at least 64 tokens; amortized
    O(1) per token). torch.cat would copy the whole cache at every decoding step (32 MiB per layer and token
    at 64k context in the 125M layout). generate() reserves its maximum length up front (`reserve`).

    keep_last: the window cache and the raw tail. An append returns what was kept plus the new tokens (a chunk's
    first query sees w - 1 keys before it), then keeps only the last keep_last; storage is compacted to its front
    only when full, with at least keep_last spare tokens, so the copies average under one token per appended
    token. While record_past is set (transformers' rollback protocol: assisted decoding), appends keep
    everything, and crop() can take back any of the tokens appended since the previous crop() (each crop then
    trims back to keep_last; recording stays on until record_past is cleared).
    Where autograd may hold views of the storage (gradients through a chunk after the cache), writes go to a
    copy of it instead (O(n), only on that path).
    fill: the value of slots never written (the compressed caches' empty slots: zero keys, end -1)."""

    def __init__(self, keep_last: int | None = None, reserve: int = 0, fill: float = 0):
        self.keep_last, self.reserve, self.fill = keep_last, reserve, fill
        self.storage: torch.Tensor | None = None  # (B, capacity, ...)
        self.start = self.end = 0  # the live tokens are storage[:, start:end]
        self.record_past = False

    def __len__(self) -> int:
        return self.end - self.start

    def view(self) -> torch.Tensor | None:
        return None if self.storage is None else self.storage.narrow(1, self.start, self.end - self.start)

    def _writable(self, new: torch.Tensor) -> None:
        """In-place writes would break tensors autograd saved from earlier chunks: write into a copy then."""
        if torch.is_grad_enabled() and (new.requires_grad or self.storage.requires_grad):
            self.storage = self.storage.clone()

    def _make_room(self, like: torch.Tensor, length: int) -> None:
        """Storage for `length` live tokens from self.start on; copies the live ones if it must move them."""
        if self.storage is not None and self.start + length <= self.storage.shape[1]:
            return
        live = self.end - self.start
        spare = max(length // 4, self.keep_last or 0, 64)
        capacity = max(length + spare, 0 if self.keep_last else self.reserve)
        storage = like.new_full((like.shape[0], capacity, *like.shape[2:]), self.fill)
        if live:
            storage[:, :live] = self.storage[:, self.start : self.end]
        self.storage, self.start, self.end = storage, 0, live

    def _store(self, tokens: torch.Tensor) -> None:
        """A fresh storage (with spare room) holding exactly `tokens` (B, n, ...)."""
        self.storage, self.start, self.end = None, 0, 0
        self._make_room(tokens, tokens.shape[1])
        self.storage[:, : tokens.shape[1]] = tokens
        self.end = tokens.shape[1]

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """new (B, m, ...) -> the live tokens plus new, (B, n + m, ...), a view of the storage."""
        num_new = new.shape[1]
        if self.keep_last is not None and not self.record_past and num_new > self.keep_last:
            # A chunk longer than what is kept (a prompt): returned whole, only its last keep_last stored, so
            # the window and tail storage stays about 2 * keep_last, not the prompt's length.
            out = new if self.storage is None else torch.cat([self.view(), new], dim=1)
            self._store(out[:, -self.keep_last :])
            return out
        self._make_room(new, self.end - self.start + num_new)
        self._writable(new)
        self.storage[:, self.end : self.end + num_new] = new
        self.end += num_new
        out = self.view()
        if self.keep_last is not None and not self.record_past:
            self.start = max(self.start, self.end - self.keep_last)
        return out

    def check_crop(self, num_tokens: int, length_after: int) -> None:
        """A keep_last buffer can take back num_tokens only if its last min(keep_last, length_after) remain."""
        if self.keep_last is not None and len(self) - num_tokens < min(self.keep_last, length_after):
            raise ValueError(
                f"NSACache.crop({-num_tokens}): the window/tail caches hold the last {len(self)} tokens, and must "
                f"keep {min(self.keep_last, length_after)} after it; call cache.activate_past_recording() before "
                "adding the tokens to be taken back (generate() does so for assisted decoding)."
            )

    def crop(self, num_tokens: int, length_after: int) -> None:
        """Take back the last num_tokens, of a sequence then length_after long (check_crop first); a keep_last
        buffer then keeps its last keep_last again."""
        self.end -= num_tokens
        if self.keep_last is not None:
            self.start = max(self.start, self.end - self.keep_last)
            if self.storage.shape[1] > 4 * max(self.keep_last, 64):  # sized by a prompt recorded whole
                self._store(self.view())

    def truncate(self, length: int) -> None:
        """Keep the first `length` live tokens (no more than there are)."""
        self.end = self.start + min(length, self.end - self.start)

    def resize(self, length: int, like: torch.Tensor) -> torch.Tensor:
        """The first `length` tokens (slots past the written ones hold `fill`), a view to write into in place."""
        self._make_room(like, length)
        self._writable(like)
        self.end = self.start + length
        return self.view()

    def index_select(self, index: torch.Tensor) -> None:
        """Reorder the rows (beam search): the live tokens only, not the whole reserved storage. An index of another
        length (a batch subset, repeated rows) makes a storage of that many rows, with the same spare room."""
        if self.storage is None:
            return
        live = self.storage[:, self.start : self.end]
        index = index.to(self.storage.device)
        if index.numel() == self.storage.shape[0]:
            self._writable(live)
            self.storage[:, self.start : self.end] = live.index_select(0, index)
            return
        storage = self.storage.new_full((index.numel(), *self.storage.shape[1:]), self.fill)
        storage[:, self.start : self.end] = live.index_select(0, index)
        self.storage = storage


class NSALayerCache:
    """One layer's decoding state; memory is bounded by what NSA reads.

    k_slc/v_slc: every key (selection may pick any block), (B, Tk, Hkv, D), rotated.
    k_win/v_win: the last w keys only, where the window has a K/V set apart from the selection's (kv_per_branch
    True, "slc" or "win"); otherwise the window reads k_slc.
    cmp_k/cmp_v/cmp_end: compressed tokens emitted so far (rotated k), (B, Tk // d + 1, ...), each row's first
    cmp_count slots filled (rows emit at different steps under left padding), the rest empty (zero, end -1).
    tail_k/tail_v: the last l - 1 raw (un-rotated) keys/values, from which the next compressed token is made.
    Each is a view of a TokenBuffer (appends write only the new tokens).
    """

    is_compileable = False
    is_croppable = True  # crop() restores exactly the state before the tokens it takes back (Cache.is_croppable)

    def __init__(self, config: NSAConfig, reserve: int = 0):
        slots = reserve // config.cmp_stride + 2  # the last step's scatter spans the previous bound + 1
        window, tail = config.window_size, config.cmp_block_size - 1
        self.buffers = {
            "k_slc": TokenBuffer(reserve=reserve), "v_slc": TokenBuffer(reserve=reserve),
            "k_win": TokenBuffer(keep_last=window), "v_win": TokenBuffer(keep_last=window),
            "tail_k": TokenBuffer(keep_last=tail), "tail_v": TokenBuffer(keep_last=tail),
            "cmp_k": TokenBuffer(reserve=slots), "cmp_v": TokenBuffer(reserve=slots),
            "cmp_end": TokenBuffer(reserve=slots, fill=-1),
        }  # fmt: skip
        self.params = NSAParams.from_config(config)
        self.cmp_count: torch.Tensor | None = None  # (B,) compressed tokens emitted per row

    def update(self, key_states, value_states, doc_pos, k_win=None, v_win=None, k_raw=None, v_raw=None,
               compress: Compress | None = None, query_end=None, compressed=None, step: TokenStep | None = None
               ) -> BranchKeys:  # fmt: skip
        """Append a chunk of Tq tokens (NSACache.update's arguments); return every key, the window's last
        w + Tq - 1 (a chunk's first query sees w - 1 before it), and the compressed tokens so far, with those the
        chunk completes made from the raw tail and the chunk (`compressed`, a whole forward's layout, is None here:
        NSAModel builds it for forwards without this cache; `step`: a one-token chunk's TokenStep)."""
        k_slc, v_slc = self.buffers["k_slc"].append(key_states), self.buffers["v_slc"].append(value_states)
        if k_raw is None:  # dense attention reads the keys only
            return BranchKeys(k_slc, v_slc)
        num_keys, num_queries = doc_pos.shape[1], k_raw.shape[1]
        if step is not None and not step.compresses and self.cmp_count is not None:
            # no row completes a compressed token at this step: only the raw tail grows
            self.buffers["tail_k"].append(k_raw)
            self.buffers["tail_v"].append(v_raw)
        else:
            k_new, v_new, end_new = self._new_compressed(k_raw, v_raw, doc_pos, compress, step)
            self._append_compressed(k_new, v_new, end_new, max_slots=num_keys // self.params.cmp_stride + 1)
        if k_win is not None:  # the window buffers keep the last w keys
            k_win, v_win = self.buffers["k_win"].append(k_win), self.buffers["v_win"].append(v_win)
        else:  # the window shares the selection's K/V set: it reads the last keys of the selection cache
            span = min(num_keys, self.params.window_size + num_queries - 1)
            k_win, v_win = k_slc[:, -span:], v_slc[:, -span:]
        return BranchKeys(k_slc, v_slc, k_win, v_win, self.cmp_k, self.cmp_v, self.cmp_end)

    def _new_compressed(self, k_raw, v_raw, doc_pos, compress: Compress, step: TokenStep | None):
        """The compressed tokens ending inside this chunk, made from the cached raw tail + the chunk (B, Tq, Hkv, D):
        k, v (B, Nn, Hkv, D) and the key index of each one's last key (B, Nn), -1 where a row emits fewer."""
        block, stride = self.params.cmp_block_size, self.params.cmp_stride
        num_keys, num_queries = doc_pos.shape[1], k_raw.shape[1]
        raw_k, raw_v = self.buffers["tail_k"].append(k_raw), self.buffers["tail_v"].append(v_raw)
        tail_len = raw_k.shape[1] - num_queries  # l - 1 (fewer at the cache's start, more while recording)
        if num_queries == 1 and tail_len >= block - 1:
            # The generation step: the token completes at most one compressed token, made from the l raw keys
            # ending at it (the tail and the token) and rotated at the token's own position.
            # A third of the general path's host work (no slot layout, no gathers): it runs per layer and token.
            step = step.on(k_raw.device)
            k_new, v_new = compress(raw_k[:, None, -block:], raw_v[:, None, -block:], keep=step.emits)  # (B, 1, Hkv, D)
            return k_new, v_new, step.end
        raw_doc_pos = doc_pos[:, num_keys - num_queries - tail_len :].clone()
        raw_doc_pos[:, :tail_len] = -1  # tail tokens emitted their compressed tokens already
        local_end = compressed_token_ends(raw_doc_pos, self.params, num_slots=num_queries // stride + 1)
        offset = num_keys - num_queries - tail_len
        global_end = torch.where(local_end >= 0, local_end + offset, local_end)
        # (a recording tail may reach before the positions the step rotated, but only tokens ending inside the
        # chunk are emitted, and their RoPE positions are the chunk's)
        k_new, v_new = compress(raw_k, raw_v, local_end, key_index=global_end)
        return k_new, v_new, global_end

    def _append_compressed(self, k_new, v_new, end_new, max_slots: int) -> None:
        """Write each row's newly emitted compressed tokens after its own count (rows emit at different steps
        under left padding), in place. The view keeps max_slots = Tk // d + 1 slots, a static bound no row
        exceeds; the scatter also writes each row's Nn - emitted spare entries (zero, end -1: what empty slots
        hold) past its count, so the buffers are sized for the previous bound + Nn."""
        batch, num_new = end_new.shape
        if self.cmp_count is None:
            self.cmp_count = torch.zeros(batch, dtype=torch.long, device=end_new.device)
        k_buf, v_buf, end_buf = (self.buffers[name] for name in ("cmp_k", "cmp_v", "cmp_end"))
        span = end_buf.end - end_buf.start + num_new
        slots = self.cmp_count[:, None] + torch.arange(num_new, device=end_new.device)  # (B, Nn)
        index = slots[:, :, None, None].expand(-1, -1, *k_new.shape[2:])
        k_buf.resize(span, k_new).scatter_(1, index, k_new)
        v_buf.resize(span, v_new).scatter_(1, index, v_new)
        end_buf.resize(span, end_new).scatter_(1, slots, end_new)
        for buffer in (k_buf, v_buf, end_buf):
            buffer.truncate(max_slots)
        self.cmp_count = self.cmp_count + (end_new >= 0).sum(-1)

    @property
    def record_past(self) -> bool:
        return any(buffer.record_past for buffer in self.buffers.values())

    @record_past.setter
    def record_past(self, value: bool) -> None:  # transformers clears it when it hands the cache back
        for buffer in self.buffers.values():
            buffer.record_past = value

    def activate_past_recording(self) -> None:
        self.record_past = True

    def crop(self, num_tokens: int, length_after: int) -> None:
        """Take back the last num_tokens (the cache then holds length_after): keys, window, raw tail, and the
        compressed tokens that end among them (per row: emptied, the count lowered)."""
        cropped = [self.buffers[name] for name in ("k_slc", "v_slc", "k_win", "v_win", "tail_k", "tail_v")]
        cropped = [buffer for buffer in cropped if buffer.storage is not None]
        for buffer in cropped:  # raises before anything changed
            buffer.check_crop(num_tokens, length_after)
        for buffer in cropped:
            buffer.crop(num_tokens, length_after)
        if self.cmp_count is not None:
            taken = self.cmp_end >= length_after  # (B, S) compressed tokens ending in the taken-back tokens
            for buffer in (self.buffers[name] for name in ("cmp_k", "cmp_v", "cmp_end")):
                buffer._writable(taken)
                slots = buffer.view()  # emptied back to what a never-written slot holds
                slots.masked_fill_(taken.view(*taken.shape, *[1] * (slots.dim() - 2)), buffer.fill)
                buffer.truncate(length_after // self.params.cmp_stride + 1)
            self.cmp_count = self.cmp_count - taken.sum(-1)

    def __getattr__(self, name):  # k_slc, cmp_end, ...: the buffer's live tokens
        buffers = self.__dict__.get("buffers", {})
        if name in buffers:
            return buffers[name].view()
        raise AttributeError(name)

    def index_select(self, index: torch.Tensor) -> None:
        for buffer in self.buffers.values():
            buffer.index_select(index)
        if self.cmp_count is not None:
            self.cmp_count = self.cmp_count.index_select(0, index.to(self.cmp_count.device))


def _static_address(tensor: torch.Tensor) -> torch.Tensor:
    """A buffer a compiled decoding step writes in place: CUDA graphs keep reading it where it is (no copy)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
    return tensor


class NSAStaticLayerCache:
    """One layer's decoding state in buffers of fixed size (NSACache(static=True)), written in place at the
    cache's device-side cursor: a decoding step has the same shapes, addresses and launches at every token, so
    torch.compile records it once (generate() compiles it on a GPU: CUDA graphs, no per-op host dispatch) and
    replays it. The price is memory: the key buffers hold max_cache_len tokens from the prompt on.

    k_slc/v_slc (B, N, Hkv, D): key p at index p (not yet written: zero, with doc_pos -1).
    k_win/v_win (B, w, Hkv, D): a ring, key p at slot p % w, where the window has a K/V set apart from the
    selection's (kv_per_branch True, "slc" or "win"); otherwise the window reads k_slc.
    tail_k/tail_v (B, l, Hkv, D): a ring of the raw keys/values, p at slot p % l (the next compressed token's).
    cmp_k/cmp_v/cmp_end (B, N // d + 2, ...): each row's compressed tokens in its first cmp_count slots, the rest
    empty (zero, end -1); the last slot takes the (empty) writes of rows that emit nothing at a step.
    """

    is_compileable = True
    is_croppable = False  # no record of past window/tail entries: speculative decoding needs the dynamic cache

    def __init__(self, config: NSAConfig, max_cache_len: int):
        self.capacity, self.num_slots = max_cache_len, max_cache_len // config.cmp_stride + 2
        self.params = NSAParams.from_config(config)
        self.tensors: dict[str, torch.Tensor] = {}  # allocated at the prompt (batch, device, dtype known then)
        self.cmp_count: torch.Tensor | None = None  # (B,) compressed tokens emitted per row

    def __getattr__(self, name):  # k_slc, cmp_end, ...: the whole buffer
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)

    def update(self, key_states, value_states, doc_pos, k_win=None, v_win=None, k_raw=None, v_raw=None,
               compress: Compress | None = None, query_end=None, compressed=None, step: TokenStep | None = None
               ) -> BranchKeys:  # fmt: skip
        """The prompt (query_end None): allocate the buffers, store its state, return its own keys (`compressed`:
        the prompt's CompressedLayout, as sequence_keys takes it). A decoding step (one token per row at key index
        query_end (1,), on the device; `step`, its TokenStep): write it in place and return the whole buffers; the
        same ops and shapes at every token, no host value read."""
        if query_end is None:
            keys = sequence_keys(key_states, value_states, k_win, v_win, k_raw, v_raw, compress, compressed)
            self.store_prompt(key_states, value_states, k_win, v_win, k_raw, v_raw, keys.k_cmp, keys.v_cmp, keys.cmp_end)
            return keys
        self.k_slc.index_copy_(1, query_end, key_states)
        self.v_slc.index_copy_(1, query_end, value_states)
        if k_raw is None:  # dense attention reads the keys only
            return BranchKeys(self.k_slc, self.v_slc, query_end=query_end)
        step = step.on(k_raw.device)
        self._store_compressed_step(k_raw, v_raw, compress, step)
        if k_win is not None:  # the window ring: key p at slot p % w
            self.k_win.index_copy_(1, step.window_slot, k_win)
            self.v_win.index_copy_(1, step.window_slot, v_win)
            k_win, v_win = self.k_win, self.v_win
        else:  # the window shares the selection's set: it reads the key buffer (a "ring" of N slots: key p at p)
            k_win, v_win = self.k_slc, self.v_slc
        return BranchKeys(self.k_slc, self.v_slc, k_win, v_win, self.cmp_k, self.cmp_v, self.cmp_end, query_end)

    def _store_compressed_step(self, k_raw, v_raw, compress: Compress, step: TokenStep) -> None:
        """The compressed token this step completes (Eq. 7): the l raw keys ending here, from the raw ring."""
        self.tail_k.index_copy_(1, step.tail_slot, k_raw)
        self.tail_v.index_copy_(1, step.tail_slot, v_raw)
        blocks = self.tail_k.index_select(1, step.tail_order)[:, None], self.tail_v.index_select(1, step.tail_order)[:, None]
        k_new, v_new = compress(*blocks, keep=step.emits)  # (B, 1, Hkv, D), rotated at the token's position
        # each row's next free slot, or (rows emitting nothing) the spare last slot, written empty
        slot = torch.where(step.emits, self.cmp_count[:, None], self.num_slots - 1)  # (B, 1)
        self.cmp_k.scatter_(1, slot[:, :, None, None].expand_as(k_new), k_new)
        self.cmp_v.scatter_(1, slot[:, :, None, None].expand_as(v_new), v_new)
        self.cmp_end.scatter_(1, slot, step.end)
        self.cmp_count.add_(step.emits[:, 0])

    def store_prompt(self, k_slc, v_slc, k_win=None, v_win=None, k_raw=None, v_raw=None, k_cmp=None, v_cmp=None,
                     cmp_end=None):
        """Allocate the buffers and write the prompt's state (its keys (B, T, Hkv, D) at 0 .. T-1; the compressed
        tokens (B, Nc, Hkv, D), valid slots first per row, as compressed_token_ends lays them out)."""
        batch, num_keys = k_slc.shape[:2]

        def buffer(like, length, fill=0):
            return _static_address(like.new_full((batch, length, *like.shape[2:]), fill))

        def ring(name, tokens, slots):  # the last `slots` tokens, key p at slot p % slots
            self.tensors[name] = buffer(tokens, slots)
            first = max(0, num_keys - slots)
            index = torch.arange(first, num_keys, device=tokens.device) % slots
            self.tensors[name].index_copy_(1, index, tokens[:, first:])

        for name, tokens in (("k_slc", k_slc), ("v_slc", v_slc)):
            self.tensors[name] = buffer(tokens, self.capacity)
            self.tensors[name][:, :num_keys] = tokens
        if k_raw is None:  # dense attention keeps keys only
            return
        if k_win is not None:  # a window K/V set of its own (else the window reads k_slc)
            ring("k_win", k_win, self.params.window_size)
            ring("v_win", v_win, self.params.window_size)
        ring("tail_k", k_raw, self.params.cmp_block_size)
        ring("tail_v", v_raw, self.params.cmp_block_size)
        num_new = cmp_end.shape[1]
        for name, tokens, fill in (("cmp_k", k_cmp, 0), ("cmp_v", v_cmp, 0), ("cmp_end", cmp_end, -1)):
            self.tensors[name] = buffer(tokens, self.num_slots, fill)
            self.tensors[name][:, :num_new] = tokens
        self.cmp_count = _static_address((cmp_end >= 0).sum(-1))

    def index_select(self, index: torch.Tensor) -> None:
        """Reorder the rows (beam search), in place: the buffers keep their addresses (so the batch keeps its size)."""
        if self.cmp_count is not None and index.numel() != self.cmp_count.shape[0]:
            raise ValueError(
                f"NSACache(static=True) holds {self.cmp_count.shape[0]} rows in buffers of fixed size and cannot take "
                f"{index.numel()}; a batch of another size needs the default cache (no cache_implementation='static')."
            )
        for tensor in [*self.tensors.values(), *([self.cmp_count] if self.cmp_count is not None else [])]:
            tensor.copy_(tensor.index_select(0, index.to(tensor.device)))

    def activate_past_recording(self) -> None:
        self.crop(0, 0)

    def crop(self, num_tokens: int, length_after: int) -> None:
        raise ValueError(
            "NSACache(static=True) cannot take tokens back (it keeps no past window or raw-tail entries); "
            "assisted and prompt-lookup decoding need the default cache: drop cache_implementation='static'."
        )


def _cache_layout(config: NSAConfig) -> dict:
    """What a cache's contents depend on: the fields two models must share to read each other's cache."""
    fields = ("num_hidden_layers", "num_key_value_heads", "head_dim", "attention_mode", "kv_per_branch",
              "cmp_block_size", "cmp_stride", "sel_block_size", "sel_num_blocks", "sel_init_blocks",
              "sel_local_blocks", "window_size")  # fmt: skip
    return {name: getattr(config, name, None) for name in fields}


class NSACache(Cache):
    """KV cache for NSA generation (NSA_SPEC, "Incremental decoding"). max_cache_len: the longest sequence
    expected (generate() passes its max_length), reserved at the first append so no step copies the cache;
    longer sequences still work (the buffers grow).

    static=True (generate(cache_implementation="static")): fixed-size buffers of max_cache_len tokens written at
    a device-side cursor (NSAStaticLayerCache), so each decoding step is the same graph; generate() then compiles
    the decoding forward on a GPU (CUDA graphs). The prompt comes first, whole; then one token per step, at
    most max_cache_len in all; no crop()."""

    def __init__(self, config: NSAConfig, max_cache_len: int = 0, static: bool = False):
        if static and max_cache_len <= 0:
            raise ValueError(
                f"NSACache(static=True) needs max_cache_len > 0 (got {max_cache_len}): the longest prompt + "
                "generated length, which its buffers hold from the start."
            )
        super().__init__(layers=self._new_layers(config, max_cache_len, static))
        # (not "max_cache_len": a read-only property of transformers' Cache in 5.17)
        self.static, self.capacity, self.config = static, max_cache_len, config
        self._empty()

    @staticmethod
    def _new_layers(config: NSAConfig, max_cache_len: int, static: bool) -> list:
        layer_class = NSAStaticLayerCache if static else NSALayerCache
        return [layer_class(config, max_cache_len) for _ in range(config.num_hidden_layers)]

    def _empty(self) -> None:
        """The state of a cache that holds no token (a new one, or reset())."""
        max_cache_len, config = self.capacity, self.config
        self.positions = TokenBuffer(reserve=max_cache_len)  # (B, Tk) in-document position of every cached token
        self.num_valid: torch.Tensor | None = None  # (B,) position the next token takes in its document
        # static: the positions of all max_cache_len keys (-1 until written) and the key index of the next token,
        # as device tensors (a compiled step must not read a host value that changes per token)
        self.static_positions: torch.Tensor | None = None
        self.cursor: torch.Tensor | None = None  # (1,) int64
        self.decoding = False  # static: the prompt is stored, steps follow
        # NSA mode: a one-token step's TokenStep, worked out once per step for every layer (append_positions)
        self.params = NSAParams.from_config(config) if config.attention_mode == "nsa" else None
        self.step: TokenStep | None = None
        # default cache, NSA mode: whether any row's next token could complete a compressed token, copied to the host
        # as each chunk is recorded (predict_emits) and read at the next step (no_row_can_emit)
        self.next_may_emit: torch.Tensor | None = None  # (1,) bool on the host (pinned beside a GPU)
        self.next_may_emit_copied = None  # the CUDA event after its copy (None on CPU)

    def check_model(self, config: NSAConfig) -> None:
        """A cache built from another model's config would be read with that model's layout (its layer count, K/V
        heads, window and compression blocks): wrong logits or an unrelated shape error. Refused naming the fields."""
        if config is self.config:
            return
        mine, theirs = _cache_layout(self.config), _cache_layout(config)
        if mine != theirs:
            diff = ", ".join(f"{k} {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs[k])
            raise ValueError(f"this NSACache was built for another model (cache vs model: {diff}); build it from the "
                             "model's own config: NSACache(model.config).")

    def check_batch(self, batch_size: int) -> None:
        """The rows of a filled cache are the rows the input continues."""
        if self.num_valid is not None and self.num_valid.shape[0] != batch_size:
            raise ValueError(
                f"the cache holds {self.num_valid.shape[0]} row(s) and the input has {batch_size}: each input row "
                "continues one cached row. To continue a cached prompt in several rows (num_return_sequences, "
                "num_beams, a batch) repeat its rows first: cache.batch_repeat_interleave(k); to keep some rows: "
                "cache.batch_select_indices(indices)."
            )

    def reset(self) -> None:
        """Empty the cache for another prompt (transformers' Cache.reset): every layer's buffers are dropped, and the
        next prompt allocates them, as in a new cache."""
        self.layers = self._new_layers(self.config, self.capacity, self.static)
        self._empty()

    @property
    def is_compileable(self) -> bool:
        return self.static

    @property
    def is_initialized(self) -> bool:
        """Whether a prompt is stored (the buffers are allocated at the first forward: batch, device and dtype)."""
        return self.num_valid is not None

    @property
    def batch_size(self) -> int:
        return -1 if self.num_valid is None else self.num_valid.shape[0]

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """The most tokens the cache holds: a static cache's max_cache_len; -1 (no bound) for the default one."""
        return self.capacity if self.static else -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(kv_length, kv_offset) as transformers' mask helpers count them: NSA builds no 4-D mask (its document
        positions carry padding and documents), but the sizes are those of its keys."""
        return (self.capacity, 0) if self.static else (self.get_seq_length() + query_length, 0)

    @property
    def doc_pos(self) -> torch.Tensor | None:
        return self.static_positions if self.static else self.positions.view()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.static:  # reads the device cursor (generate asks before the prompt and between chunks only)
            return 0 if self.cursor is None else int(self.cursor)
        return len(self.positions)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity if self.static else -1

    def update(self, key_states, value_states, layer_idx: int, doc_pos, k_win=None, v_win=None, k_raw=None,
               v_raw=None, compress: Compress | None = None, compressed: CompressedLayout | None = None) -> BranchKeys:
        """Store one attention step's keys in layer `layer_idx` and return what its branches read (Llama's
        Cache.update, with NSA's branches). key_states/value_states (B, Tq, Hkv, D): the selection keys (dense
        attention's keys), rotated; doc_pos (B, Tk): as append_positions returned it. NSA mode adds k_win/v_win
        (rotated; None where the window shares the selection's K/V set), k_raw/v_raw (un-rotated, compression's
        input), `compress` and, for a static cache's prompt, the prompt's CompressedLayout (NSAModel builds it once
        for every layer)."""
        query_end = self.cursor if self.decoding else None  # a static cache's step: written at the cursor
        return self.layers[layer_idx].update(key_states, value_states, doc_pos, k_win, v_win, k_raw, v_raw, compress,
                                             query_end, compressed, self.step)

    def append_positions(self, position_ids, attention_mask, batch_size, new_len, device) -> torch.Tensor:
        """Record the new tokens' doc_pos; returns doc_pos of every key position (B, Tk).

        Every chunk follows a forward's document rules (a document starts where position_ids is 0 and after
        padding), so a row fed in chunks gets the doc_pos of one forward over it: a chunk's first token
        continues the row's last document (generation) unless a rule starts a new one there.
        A static cache returns the prompt's positions for the prompt, then the whole (B, max_cache_len) buffer."""
        self.check_batch(batch_size)
        if self.static:
            return self._append_static_positions(position_ids, attention_mask, batch_size, new_len, device)
        if self.num_valid is None:
            new_doc_pos = document_positions(position_ids, attention_mask, batch_size, new_len, device)
        else:
            new_doc_pos = cached_document_positions(position_ids, attention_mask, self.num_valid, batch_size, new_len,
                                                    device)
        doc_pos = self.positions.append(new_doc_pos)
        self.num_valid = new_doc_pos[:, -1] + 1  # the next token's position in the row's last document
        self.step = None
        if new_len == 1 and self.params is not None:
            if self.no_row_can_emit():
                self.step = TokenStep(None, None, compresses=False)
            else:
                emits = ends_compressed_token(new_doc_pos, self.params)  # (B, 1)
                self.step = TokenStep(emits, torch.where(emits, doc_pos.shape[1] - 1, -1))
        self.predict_emits()
        return doc_pos

    def predict_emits(self) -> None:
        """After a chunk is recorded (default cache, NSA mode): whether any row's next token could complete a
        compressed token, copied to the host without waiting for it. Only a token that continues its row's document
        can: it sits at num_valid, and completes one where that is i*d + l - 1 (Eq. 7); a token that starts a
        document sits at 0, which completes one only where l = 1 (d = 1: then every position does, num_valid's
        too, so the flag is always set), and padding never does. So False here is a
        guarantee about the next step whatever its attention mask and position_ids (beam search's row reordering
        keeps it: a subset of rows). Eager steps only (a compiled or CUDA-graph-captured step computes every
        step's compressed token), and in one process only (runs_in_lockstep_with_other_ranks)."""
        self.next_may_emit = self.next_may_emit_copied = None
        if self.params is None or self.num_valid is None or not is_eager_step(self.num_valid):
            return
        if runs_in_lockstep_with_other_ranks():
            return
        may_emit = ends_compressed_token(self.num_valid, self.params).any()
        on_gpu = may_emit.is_cuda
        self.next_may_emit = torch.empty(1, dtype=torch.bool, pin_memory=on_gpu)
        self.next_may_emit.copy_(may_emit.view(1), non_blocking=on_gpu)
        if on_gpu:  # (on the stream of the flag's GPU, where the copy runs: a model split over GPUs may be elsewhere)
            self.next_may_emit_copied = torch.cuda.Event()
            self.next_may_emit_copied.record(torch.cuda.current_stream(may_emit.device))

    def no_row_can_emit(self) -> bool:
        """Whether the step being recorded is known to complete no compressed token in any row (predict_emits, at the
        step before): the layers then skip the compressor, its RoPE and the compressed caches' writes (23 of a
        layer's ~70 ops; at batch 1, d - 1 steps of every d). The flag was copied during the step before, so
        waiting for it costs nothing: eager generate() has synchronized since (its stopping check), and steps still
        pipeline where it does not (transformers' deferred stop check)."""
        if self.next_may_emit is None or not is_eager_step(self.num_valid):
            return False
        if self.next_may_emit_copied is not None:
            self.next_may_emit_copied.synchronize()
        return not self.next_may_emit.tolist()[0]  # (a host tensor: no device read)

    def _append_static_positions(self, position_ids, attention_mask, batch_size, new_len, device) -> torch.Tensor:
        if not self.decoding:  # the prompt (eager: generate() compiles the steps after it)
            if new_len > self.capacity:
                raise ValueError(
                    f"NSACache(static=True, max_cache_len={self.capacity}) cannot hold a prompt of {new_len} "
                    "tokens; make max_cache_len at least prompt + new tokens."
                )
            doc_pos = document_positions(position_ids, attention_mask, batch_size, new_len, device)
            self.static_positions = _static_address(doc_pos.new_full((batch_size, self.capacity), -1))
            self.static_positions[:, :new_len] = doc_pos
            self.num_valid = _static_address(doc_pos[:, -1] + 1)
            self.cursor = _static_address(torch.full((1,), new_len, dtype=torch.long, device=device))
            return doc_pos
        if new_len != 1:
            raise ValueError(
                f"NSACache(static=True) takes one token per step after the prompt, got {new_len}; chunked "
                "prefill and speculative decoding need the default cache (no cache_implementation='static')."
            )
        # a step past the buffers would index out of them (a device-side assert on CUDA). generate() sizes them from
        # max_length, so only hand-driven steps get here; checked eagerly only (a host read of the cursor, which an
        # eager step's stopping check has synchronized anyway; a compiled step or one captured into a CUDA graph
        # must not read it)
        if is_eager_step(self.cursor) and int(self.cursor) >= self.capacity:
            raise ValueError(
                f"NSACache(static=True, max_cache_len={self.capacity}) is full: it holds {self.capacity} tokens "
                "and cannot take another; make max_cache_len at least prompt + new tokens."
            )
        new_doc_pos = cached_document_positions(position_ids, attention_mask, self.num_valid, batch_size, 1,
                                                device)  # (B, 1)
        self.static_positions.index_copy_(1, self.cursor, new_doc_pos)
        self.num_valid.copy_(new_doc_pos[:, 0] + 1)
        if self.params is not None:
            block, cursor = self.params.cmp_block_size, self.cursor
            emits = ends_compressed_token(new_doc_pos, self.params)  # (B, 1)
            self.step = TokenStep(emits, torch.where(emits, cursor, -1), cursor % block, cursor % self.params.window_size,
                                  (cursor - block + 1 + torch.arange(block, device=device)) % block)  # fmt: skip
        return self.static_positions

    def advance(self, num_new: int) -> None:
        """After every layer saw the chunk: a static cache moves its cursor past it (in place, on the device)."""
        if self.static:
            if self.decoding:
                self.cursor.add_(num_new)
            self.decoding = True

    def activate_past_recording(self, **kwargs) -> None:
        """From now on keep every appended token until the next crop(), so crop() can take any of them back
        (transformers calls this for assisted decoding; `layer.record_past = False` ends it).

        kwargs: taken and unused, as transformers' Cache takes any keyword here. From 5.25 its assisted decoding
        passes `recurrent_states_to_keep` (how many steps of a linear-attention layer's recurrent state to keep
        for a rollback); NSA's layers keep tokens, not a recurrent state, and recording keeps all of them."""
        for layer in self.layers:
            layer.activate_past_recording()

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last -tokens_to_remove tokens (a negative count or 0, as transformers' caches take it:
        assisted decoding drops the rejected draft tokens). Deeper than the tokens added since
        activate_past_recording() (or than w and l - 1 without it) raises."""
        if self.static:
            self.layers[0].crop(-tokens_to_remove, 0)  # raises: says what to use instead
        if tokens_to_remove > 0:
            raise ValueError(f"NSACache.crop({tokens_to_remove}): pass minus the number of tokens to take back.")
        num_tokens, length = -tokens_to_remove, self.get_seq_length()
        if num_tokens > length:
            raise ValueError(f"NSACache.crop({tokens_to_remove}): the cache holds only {length} tokens.")
        for layer in self.layers:  # every layer holds the same lengths: the first raises before any changed
            layer.crop(num_tokens, length - num_tokens)
        self.positions.truncate(length - num_tokens)
        self.num_valid = self.doc_pos[:, -1] + 1 if length > num_tokens else None
        self.predict_emits()  # (rows moved back: their next tokens sit elsewhere in the compression cycle)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (any number, in that order; transformers' Cache.batch_select_indices)."""
        self.reorder_cache(torch.as_tensor(indices, dtype=torch.long))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row `repeats` times in a row (transformers' Cache.batch_repeat_interleave: a prompt's cache
        expanded for several samples or beams)."""
        if self.num_valid is not None:
            rows = torch.arange(self.num_valid.shape[0], device=self.num_valid.device)
            self.reorder_cache(rows.repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Rows in the order of beam_idx (beam search); a length other than the batch's keeps or repeats rows
        (the default cache only: a static cache's buffers keep their size)."""
        if self.num_valid is None:  # nothing stored yet
            return
        for layer in self.layers:
            layer.index_select(beam_idx)
        if self.static:
            for tensor in (self.static_positions, self.num_valid):
                tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))
            return
        self.positions.index_select(beam_idx)
        self.num_valid = self.num_valid.index_select(0, beam_idx.to(self.num_valid.device))
