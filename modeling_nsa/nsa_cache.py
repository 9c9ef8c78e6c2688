"""NSA's generation cache: NSACache (a transformers Cache) with one NSALayerCache per layer (growing buffers) or,
static=True, one NSAStaticLayerCache per layer (fixed-size buffers a compiled decoding step writes in place).

Imports only torch, transformers and flat siblings (it travels with checkpoints as remote code; no triton).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .configuration_nsa import NSAConfig
from .nsa_layout import cached_document_positions, document_positions


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
        """Reorder the rows (beam search): the live tokens only, not the whole reserved storage."""
        if self.storage is not None:
            live = self.storage[:, self.start : self.end]
            self._writable(live)
            self.storage[:, self.start : self.end] = live.index_select(0, index.to(self.storage.device))


class NSALayerCache:
    """One layer's decoding state; memory is bounded by what NSA reads.

    k_slc/v_slc: every key (selection may pick any block), (B, Tk, Hkv, D), rotated.
    k_win/v_win: the last w keys only (kv_per_branch; otherwise the window reads k_slc).
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
        self.cmp_stride = config.cmp_stride
        self.cmp_count: torch.Tensor | None = None  # (B,) compressed tokens emitted per row

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
                buffer.truncate(length_after // self.cmp_stride + 1)
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
    k_win/v_win (B, w, Hkv, D): a ring, key p at slot p % w (kv_per_branch; otherwise the window reads k_slc).
    tail_k/tail_v (B, l, Hkv, D): a ring of the raw keys/values, p at slot p % l (the next compressed token's).
    cmp_k/cmp_v/cmp_end (B, N // d + 2, ...): each row's compressed tokens in its first cmp_count slots, the rest
    empty (zero, end -1); the last slot takes the (empty) writes of rows that emit nothing at a step.
    """

    is_compileable = True
    is_croppable = False  # no record of past window/tail entries: speculative decoding needs the dynamic cache

    def __init__(self, config: NSAConfig, max_cache_len: int):
        self.capacity, self.num_slots = max_cache_len, max_cache_len // config.cmp_stride + 2
        self.window_size, self.block_size = config.window_size, config.cmp_block_size
        self.separate_window = config.kv_per_branch and config.attention_mode != "dense"
        self.tensors: dict[str, torch.Tensor] = {}  # allocated at the prompt (batch, device, dtype known then)
        self.cmp_count: torch.Tensor | None = None  # (B,) compressed tokens emitted per row

    def __getattr__(self, name):  # k_slc, cmp_end, ...: the whole buffer
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)

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
        if self.separate_window:
            ring("k_win", k_win, self.window_size)
            ring("v_win", v_win, self.window_size)
        ring("tail_k", k_raw, self.block_size)
        ring("tail_v", v_raw, self.block_size)
        num_new = cmp_end.shape[1]
        for name, tokens, fill in (("cmp_k", k_cmp, 0), ("cmp_v", v_cmp, 0), ("cmp_end", cmp_end, -1)):
            self.tensors[name] = buffer(tokens, self.num_slots, fill)
            self.tensors[name][:, :num_new] = tokens
        self.cmp_count = _static_address((cmp_end >= 0).sum(-1))

    def index_select(self, index: torch.Tensor) -> None:
        """Reorder the rows (beam search), in place: the buffers keep their addresses."""
        for tensor in [*self.tensors.values(), *([self.cmp_count] if self.cmp_count is not None else [])]:
            tensor.copy_(tensor.index_select(0, index.to(tensor.device)))

    def activate_past_recording(self) -> None:
        self.crop(0, 0)

    def crop(self, num_tokens: int, length_after: int) -> None:
        raise ValueError(
            "NSACache(static=True) cannot take tokens back (it keeps no past window or raw-tail entries); "
            "assisted and prompt-lookup decoding need the default cache: drop cache_implementation='static'."
        )


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
        layer_class = NSAStaticLayerCache if static else NSALayerCache
        super().__init__(layers=[layer_class(config, max_cache_len) for _ in range(config.num_hidden_layers)])
        # (not "max_cache_len": a read-only property of transformers' Cache in 5.17)
        self.static, self.capacity = static, max_cache_len
        self.positions = TokenBuffer(reserve=max_cache_len)  # (B, Tk) in-document position of every cached token
        self.num_valid: torch.Tensor | None = None  # (B,) position the next token takes in its document
        # static: the positions of all max_cache_len keys (-1 until written) and the key index of the next token,
        # as device tensors (a compiled step must not read a host value that changes per token)
        self.static_positions: torch.Tensor | None = None
        self.cursor: torch.Tensor | None = None  # (1,) int64
        self.decoding = False  # static: the prompt is stored, steps follow

    @property
    def is_compileable(self) -> bool:
        return self.static

    @property
    def doc_pos(self) -> torch.Tensor | None:
        return self.static_positions if self.static else self.positions.view()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.static:  # reads the device cursor (generate asks before the prompt and between chunks only)
            return 0 if self.cursor is None else int(self.cursor)
        return len(self.positions)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity if self.static else -1

    def append_positions(self, position_ids, attention_mask, batch_size, new_len, device) -> torch.Tensor:
        """Record the new tokens' doc_pos; returns doc_pos of every key position (B, Tk).

        Every chunk follows a forward's document rules (a document starts where position_ids is 0 and after
        padding), so a row fed in chunks gets the doc_pos of one forward over it: a chunk's first token
        continues the row's last document (generation) unless a rule starts a new one there.
        A static cache returns the prompt's positions for the prompt, then the whole (B, max_cache_len) buffer."""
        if self.static:
            return self._append_static_positions(position_ids, attention_mask, batch_size, new_len, device)
        if self.num_valid is None:
            new_doc_pos = document_positions(position_ids, attention_mask, batch_size, new_len, device)
        else:
            new_doc_pos = cached_document_positions(position_ids, attention_mask, self.num_valid, batch_size, new_len,
                                                    device)
        doc_pos = self.positions.append(new_doc_pos)
        self.num_valid = new_doc_pos[:, -1] + 1  # the next token's position in the row's last document
        return doc_pos

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
        new_doc_pos = cached_document_positions(position_ids, attention_mask, self.num_valid, batch_size, 1,
                                                device)  # (B, 1)
        self.static_positions.index_copy_(1, self.cursor, new_doc_pos)
        self.num_valid.copy_(new_doc_pos[:, 0] + 1)
        return self.static_positions

    def advance(self, num_new: int) -> None:
        """After every layer saw the chunk: a static cache moves its cursor past it (in place, on the device)."""
        if self.static:
            if self.decoding:
                self.cursor.add_(num_new)
            self.decoding = True

    def activate_past_recording(self) -> None:
        """From now on keep every appended token until the next crop(), so crop() can take any of them back
        (transformers calls this for assisted decoding; `layer.record_past = False` ends it)."""
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

    def reorder_cache(self, beam_idx: torch.LongTensor):
        for layer in self.layers:
            layer.index_select(beam_idx)
        if self.static:
            for tensor in (self.static_positions, self.num_valid):
                tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))
            return
        self.positions.index_select(beam_idx)
        self.num_valid = self.num_valid.index_select(0, beam_idx.to(self.num_valid.device))


def _append_compressed(layer: NSALayerCache, k_new, v_new, end_new, max_slots: int):
    """Write each row's newly emitted compressed tokens after its own count (rows emit at different steps
    under left padding), in place. The view keeps max_slots = Tk // d + 1 slots, a static bound no row
    exceeds; the scatter also writes each row's Nn - emitted spare entries (zero, end -1: what empty slots
    hold) past its count, so the buffers are sized for the previous bound + Nn."""
    batch, num_new = end_new.shape
    if layer.cmp_count is None:
        layer.cmp_count = torch.zeros(batch, dtype=torch.long, device=end_new.device)
    k_buf, v_buf, end_buf = (layer.buffers[name] for name in ("cmp_k", "cmp_v", "cmp_end"))
    span = end_buf.end - end_buf.start + num_new
    slots = layer.cmp_count[:, None] + torch.arange(num_new, device=end_new.device)  # (B, Nn)
    index = slots[:, :, None, None].expand(-1, -1, *k_new.shape[2:])
    k_buf.resize(span, k_new).scatter_(1, index, k_new)
    v_buf.resize(span, v_new).scatter_(1, index, v_new)
    end_buf.resize(span, end_new).scatter_(1, slots, end_new)
    for buffer in (k_buf, v_buf, end_buf):
        buffer.truncate(max_slots)
    layer.cmp_count = layer.cmp_count + (end_new >= 0).sum(-1)
