"""NSA decoder (Llama-style) for transformers: attention = Native Sparse Attention (arXiv 2502.11089).

Class split follows transformers' modeling_llama.py: NSARMSNorm, NSAMLP, NSARotaryEmbedding,
NSACompressor, NSAAttention, NSADecoderLayer, NSAPreTrainedModel, NSAModel, NSAForCausalLM; the generation
cache (NSACache) lives in `nsa_cache.py`. The attention math lives behind one seam, `nsa_backend.nsa_attention(...)`,
with two implementations: `nsa_reference.py` (PyTorch, CPU path and oracle) and `nsa_triton.py` (GPU).

This file travels as remote code: it imports only torch, transformers and its flat siblings.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import can_return_tuple

from .configuration_nsa import BRANCHES, COMPRESSORS_WITH_MLP, NSAConfig, check_attn_implementation
from .nsa_backend import (  # noqa: F401  (resolve_nsa_backend, _logged_once: importable from here, as before)
    _check_explicit_triton,
    _log_once,
    _logged_once,
    nsa_attention,
    resolve_nsa_backend,
)
from .nsa_cache import BranchKeys, NSACache, sequence_keys
from .nsa_layout import (
    CompressedLayout,
    NSAParams,
    compressed_layout,
    compression_block_index,
    dense_attention_kwargs,
    document_positions,
    document_positions_from_cu_seqlens,
    gather_compression_blocks,
)

# transformers 5.24 renamed past_key_values to cache (generate() passes the new name, outputs hold it); the
# transformers range this project supports has either, so the cache travels under the name the installed one uses
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


# ----------------------------------------------------------------------------------------------
# The seam, nsa_backend.nsa_attention (imported above), computes a layer's NSA from q, per-branch k/v, gates
# and documents, and alone decides reference or Triton. Its document layout's checks:
# ----------------------------------------------------------------------------------------------


def _check_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> None:
    """cu_seqlens must be [0, n1, n1 + n2, ...]: 1-D, starting at 0, non-decreasing, ending at most at T."""
    values = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() != 1 or len(values) < 2:
        raise ValueError(f"cu_seqlens must be a 1-D list of at least 2 cumulative lengths [0, n1, n1 + n2, ...], "
                         f"got {values}.")
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] > seq_len:
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at most at the row's {seq_len} "
                         f"tokens (the cumulative document lengths [0, n1, n1 + n2, ...]); got {values}.")


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


class NSARMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class NSAMLP(nn.Module):
    """Gated feed-forward: SwiGLU with hidden_act "silu" (the default), as Llama's."""

    def __init__(self, config: NSAConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class NSARotaryEmbedding(nn.Module):
    """RoPE at in-document positions, so every document (and every compressed token) is rotated
    as if it stood alone: q, k_slc, k_win at their doc_pos, compressed key i at i*d + l - 1."""

    def __init__(self, config: NSAConfig):
        super().__init__()
        exponent = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta**exponent), persistent=False)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions (B, T) int (padding -1 is rotated as 0) -> cos, signed_sin (B, T, D): signed_sin is sin with
        its first half negated, rotate_half's sign folded in once per forward (apply_rope)."""
        freqs = positions.clamp(min=0).float()[..., None] * self.inv_freq.float()  # (B, T, D/2)
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Llama's x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)) as
    x * cos + (x2, x1) * signed_sin, signed_sin = (-sin, sin) (NSARotaryEmbedding's second output): one flip and one
    addcmul where rotate_half took a neg, a cat and a mul, on every q, k and compressed k of every layer (an eager
    decoding step dispatches each op of each layer per token; a training step moves each op's bytes).
    x (B, T, heads, D), cos/signed_sin (B, T, 1, D) (one head axis to broadcast, made once per layer) -> x rotated,
    in x's dtype. Under autocast the projections are bf16 and cos/sin float32: the product is rounded back to bf16
    once, which is what attention consumes (the kernels and SDPA run in the autocast dtype), and the K cache stays
    bf16 (half the memory, and no cast of the whole cache at every decoding step)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2, x1)
    return torch.addcmul(x * cos, swapped, signed_sin).to(x.dtype)


class NSACompressor(nn.Module):
    """φ of Eq. 7: summarizes the l raw (un-rotated) keys or values of a compressed block into one.

    "mlp" (the paper's learnable φ): intra-block position embedding (l x D) added to the keys,
    flattened, then Linear(l*D -> hidden) -> GELU -> Linear(hidden -> D); separate φ for K and V,
    shared across KV heads. "mean": the block average (no parameters; fla's choice). "mean_mlp": the block
    average plus the paper's φ, whose output layer starts at zero: it begins as "mean" (whose compressed keys
    rank blocks like the keys they cover from the first step) and learns away from it (bench/QUALITY.md).
    """

    def __init__(self, config: NSAConfig):
        super().__init__()
        self.mode = config.compressor
        self.block_size, head_dim = config.cmp_block_size, config.head_dim
        if self.mode in COMPRESSORS_WITH_MLP:
            hidden = config.cmp_mlp_hidden_size
            self.k_pos_emb = nn.Parameter(torch.zeros(self.block_size, head_dim))
            self.v_pos_emb = nn.Parameter(torch.zeros(self.block_size, head_dim))
            self.k_mlp = nn.Sequential(
                nn.Linear(self.block_size * head_dim, hidden), nn.GELU(), nn.Linear(hidden, head_dim)
            )
            self.v_mlp = nn.Sequential(
                nn.Linear(self.block_size * head_dim, hidden), nn.GELU(), nn.Linear(hidden, head_dim)
            )
            if self.mode == "mean_mlp":  # φ's output layers start at zero (_init_weights): the block mean at first
                self.k_mlp[2]._nsa_zero_init = self.v_mlp[2]._nsa_zero_init = True

    def _compress(self, blocks, pos_emb, mlp):  # (B, N, l, Hkv, D) -> (B, N, Hkv, D)
        if self.mode == "mean":
            return blocks.mean(dim=2)
        batch, num_slots, block, num_kv_heads, head_dim = blocks.shape
        positioned = blocks + pos_emb[:, None, :].to(blocks.dtype)
        flat = positioned.permute(0, 1, 3, 2, 4).reshape(batch, num_slots, num_kv_heads, block * head_dim)
        if self.mode == "mean_mlp":
            return blocks.mean(dim=2) + mlp(flat)  # the mean of the raw keys, without the position embedding
        return mlp(flat)

    def forward(self, k, v, cmp_end=None, keep=None, block_index=None):
        """Compressed k, v (B, N, Hkv, D), zero at empty slots, from either
        - raw keys/values k, v (B, T, Hkv, D) and cmp_end (B, N): the blocks are gathered here;
        - raw keys/values, block_index (B, N * l) and keep (B, N) (a CompressedLayout's, built once per forward); or
        - blocks k, v (B, N, l, Hkv, D) gathered by the caller and keep (B, N) bool (a decoding step's own block).
        All go through forward: hooks that load weights as a module runs (accelerate's offloading) see every use."""
        if cmp_end is not None:
            block_index, keep = compression_block_index(cmp_end, self.block_size, k.shape[1]), cmp_end >= 0
        if block_index is not None:
            k = gather_compression_blocks(k, block_index, self.block_size)
            v = gather_compression_blocks(v, block_index, self.block_size)
        keep = keep[:, :, None, None]
        k = self._compress(k, getattr(self, "k_pos_emb", None), getattr(self, "k_mlp", None))
        v = self._compress(v, getattr(self, "v_pos_emb", None), getattr(self, "v_mlp", None))
        return k * keep, v * keep


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


class NSAAttention(nn.Module):
    """Projections, RoPE, compression and the gated three-branch NSA (or dense causal attention)."""

    def __init__(self, config: NSAConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.dense = config.attention_mode == "dense"
        self.is_causal, self.num_key_value_groups = True, config.num_key_value_groups  # (transformers' attention functions)
        # Independent K/V per branch (paper §3.3.3), one shared K/V, or one branch's own and a shared one
        self.kv_set_of_branch, self.num_kv_sets = config.kv_set_of_branch, config.num_kv_sets
        self.params = NSAParams.from_config(config)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, self.num_kv_sets * 2 * self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        if not self.dense:
            self.g_proj = nn.Linear(config.hidden_size, self.num_heads * len(BRANCHES), bias=False)
            self.compressor = NSACompressor(config)

    def extra_repr(self) -> str:
        heads = f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        if self.dense:
            return f"{heads}, dense ({self.config._attn_implementation or 'sdpa'})"
        p = self.params
        return (f"{heads}, kv_sets={self.num_kv_sets}, l={p.cmp_block_size}, d={p.cmp_stride}, "
                f"l'={p.sel_block_size}, n={p.sel_num_blocks}, w={p.window_size}")

    def _branch_kv(self, kv, branch: str):
        """kv: the K/V projection's sets x (k, v) tensors (B, T, Hkv, D) (one unbind: its backward writes their
        gradients into one tensor, where a select per tensor writes a zero-filled copy of the whole projection
        each and sums them) -> k, v of one branch (its own set, or the set it shares: config.kv_set_of_branch)."""
        index = self.kv_set_of_branch[branch]
        return kv[2 * index], kv[2 * index + 1]

    def forward(self, hidden_states, doc_pos, position_embeddings, past_key_values=None, single_document=False,
                dense_attention=None, compressed: CompressedLayout | None = None, **kwargs):
        """hidden_states (B, Tq, hidden); doc_pos (B, Tk) of every key position (Tk = cached + Tq);
        position_embeddings = cos, signed_sin (B, W, D) at the last W of doc_pos: all Tk without a cache, the last
        Tq + l - 1 with one (the queries and the compressed tokens they complete); single_document: no padding, no packed
        documents, no cache (lets dense attention use the plain causal kernel); dense_attention: the documents as
        the attention function takes them (nsa_layout.dense_attention_kwargs; NSAModel builds them once);
        compressed: NSA's compressed tokens' layout, for a forward without cache or a static cache's prompt
        (nsa_layout.compressed_layout; NSAModel builds it once, and here when it did not)."""
        batch, num_queries, _ = hidden_states.shape
        cos, signed_sin = position_embeddings
        cos_q, sin_q = cos[:, -num_queries:, None], signed_sin[:, -num_queries:, None]  # (B, Tq, 1, D)
        q = apply_rope(self.q_proj(hidden_states).view(batch, num_queries, self.num_heads, self.head_dim), cos_q, sin_q)
        kv = self.kv_proj(hidden_states).view(batch, num_queries, self.num_kv_sets * 2, self.num_kv_heads, self.head_dim)
        kv = kv.unbind(2)  # (k, v) of each set, each (B, Tq, Hkv, D)
        if self.dense:
            k, v = self._branch_kv(kv, "slc")
            k = apply_rope(k, cos_q, sin_q)
            keys = BranchKeys(k, v) if past_key_values is None else past_key_values.update(k, v, self.layer_idx, doc_pos)
            implementation = self.config._attn_implementation or "sdpa"
            if dense_attention is None:
                dense_attention = dense_attention_kwargs(implementation, doc_pos, num_queries, keys.query_end,
                                                         single_document, q.dtype)  # fmt: skip
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
            out, weights = attention(self, q.transpose(1, 2), keys.k_slc.transpose(1, 2), keys.v_slc.transpose(1, 2),
                                     scaling=self.head_dim**-0.5, dropout=0.0, **dense_attention)  # fmt: skip
        else:
            weights = None  # the three branches never form a (Tq x Tk) attention matrix
            gates = torch.sigmoid(self.g_proj(hidden_states)).view(batch, num_queries, self.num_heads, len(BRANCHES))
            k_raw, v_raw = self._branch_kv(kv, "cmp")  # compression reads un-rotated keys (Eq. 7)
            k_slc, v_slc = self._branch_kv(kv, "slc")
            k_slc = apply_rope(k_slc, cos_q, sin_q)
            k_win = v_win = None  # a K/V set shared with the selection: the window reads the selection keys
            if self.kv_set_of_branch["win"] != self.kv_set_of_branch["slc"]:
                k_win, v_win = self._branch_kv(kv, "win")
                k_win = apply_rope(k_win, cos_q, sin_q)
            step = dict(k_win=k_win, v_win=v_win, k_raw=k_raw, v_raw=v_raw,
                        compress=partial(self._compress, cos=cos, signed_sin=signed_sin, num_keys=doc_pos.shape[1]))
            whole_rows = past_key_values is None or (past_key_values.static and not past_key_values.decoding)
            if compressed is None and whole_rows:  # (a layer called on its own)
                compressed = compressed_layout(doc_pos, self.params, cos, signed_sin)
            if past_key_values is None:
                keys = sequence_keys(k_slc, v_slc, **step, compressed=compressed)
            else:
                keys = past_key_values.update(k_slc, v_slc, self.layer_idx, doc_pos, **step, compressed=compressed)
            out = nsa_attention(
                q, keys.k_cmp, keys.v_cmp, keys.cmp_end, keys.k_slc, keys.v_slc, keys.k_win, keys.v_win, gates, doc_pos,
                self.params, backend=self.config.nsa_backend, query_end=keys.query_end,
            )  # fmt: skip
        return self.o_proj(out.reshape(batch, num_queries, self.num_heads * self.head_dim)), weights

    def _compress(self, k, v, cmp_end=None, keep=None, key_index=None, compressed: CompressedLayout | None = None, *,
                  cos, signed_sin, num_keys):
        """Compressed k, rotated at the position of the last key each covers (Eq. 7), and v (B, N, Hkv, D), through
        the compressor's forward (hooks that load weights as a module runs, accelerate's offloading, see it).
        k, v: raw keys (B, T, Hkv, D) with the forward's CompressedLayout, or with cmp_end (B, N) indexing them, or
        gathered blocks (B, N, l, Hkv, D) with keep (B, N). key_index (B, N): each token's last key among the
        num_keys keys (-1: empty), whose last W positions cos/signed_sin (B, W, D) cover; None: the step's last
        position (a decoding step's one block)."""
        if compressed is not None:
            k_cmp, v_cmp = self.compressor(k, v, keep=compressed.keep, block_index=compressed.block_index)
            return apply_rope(k_cmp, compressed.cos, compressed.signed_sin), v_cmp
        k_cmp, v_cmp = self.compressor(k, v, cmp_end, keep)
        if key_index is None:
            return apply_rope(k_cmp, cos[:, -1:, None], signed_sin[:, -1:, None]), v_cmp
        index = (key_index + cos.shape[1] - num_keys).clamp(min=0)  # (empty slots: zero, rotated anywhere)
        gather = index[:, :, None].expand(-1, -1, cos.shape[-1])
        return apply_rope(k_cmp, cos.gather(1, gather)[:, :, None], signed_sin.gather(1, gather)[:, :, None]), v_cmp


def eager_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Softmax attention written out (attn_implementation="eager"): query (B, H, Tq, D), key/value (B, Hkv, Tk, D),
    attention_mask additive (B, 1, Tq, Tk) -> output (B, Tq, H, D) and the weights (B, H, Tq, Tk)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if attention_mask is not None:
        scores = scores + attention_mask
    # softmax in float32 at least (bf16 scores would round the normalizer), then back to the inputs' dtype
    weights = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


# ----------------------------------------------------------------------------------------------
# Layers and models
# ----------------------------------------------------------------------------------------------


class NSADecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: NSAConfig, layer_idx: int):
        super().__init__()
        self.self_attn = NSAAttention(config, layer_idx)
        self.mlp = NSAMLP(config)
        self.input_layernorm = NSARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = NSARMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, doc_pos, position_embeddings, past_key_values=None, single_document=False,
                dense_attention=None, compressed=None, **kwargs):
        residual = hidden_states
        attn_out, _ = self.self_attn(
            self.input_layernorm(hidden_states), doc_pos, position_embeddings, past_key_values, single_document,
            dense_attention, compressed,
        )
        hidden_states = residual + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class NSAPreTrainedModel(PreTrainedModel):
    config: NSAConfig
    config_class = NSAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["NSADecoderLayer"]
    _skip_keys_device_placement = [CACHE_NAME]
    # attention_mode="dense" runs transformers' attention functions (attn_implementation); NSA mode its own kernels
    _supports_sdpa = _supports_flex_attn = _supports_flash_attn = _supports_attention_backend = True

    def __init__(self, config: NSAConfig, *args, **kwargs):
        # Every model class checks its config when built: a field may have been set since it was constructed
        # (the same check the config runs then), and the backend must handle the NSA parameters.
        config.validate_nsa()
        _check_explicit_triton(config)
        super().__init__(config, *args, **kwargs)

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        # from_pretrained(attn_implementation=...) and set_attn_implementation() pass here; NSA mode refuses a choice
        # it would not use (configuration_nsa.check_attn_implementation)
        check_attn_implementation(self.config.attention_mode, attn_implementation)
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Record both Auto classes in the saved config's `auto_map`, whichever class is saved, so the checkpoint
        loads with AutoModel and AutoModelForCausalLM (trust_remote_code=True). The live config keeps its own
        auto_map (none for a model built here): saving does not change the model."""
        had, before = hasattr(self.config, "auto_map"), getattr(self.config, "auto_map", None)
        self.config.auto_map = {
            **(before or {}),
            "AutoConfig": "configuration_nsa.NSAConfig",
            "AutoModel": "modeling_nsa.NSAModel",
            "AutoModelForCausalLM": "modeling_nsa.NSAForCausalLM",
        }
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            if had:
                self.config.auto_map = before
            else:
                del self.config.auto_map

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, NSACompressor) and module.mode in COMPRESSORS_WITH_MLP:
            init.normal_(module.k_pos_emb, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.v_pos_emb, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, nn.Linear) and getattr(module, "_nsa_zero_init", False):
            # "mean_mlp"'s φ output layers, zeroed where the Linear itself is initialized: transformers skips a
            # module whose own parameters all loaded, so the compressor's visit may not happen when only these are
            # missing from a checkpoint
            init.zeros_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, NSARotaryEmbedding):
            exponent = torch.arange(0, self.config.head_dim, 2, dtype=torch.float32) / self.config.head_dim
            init.copy_(module.inv_freq, 1.0 / (self.config.rope_theta**exponent))


def check_cache(cache, config: NSAConfig) -> None:
    """The cache a caller passes is an NSACache of this model's layout: any other (a transformers DynamicCache or
    StaticCache, a legacy tuple) holds none of NSA's compressed and selection state, and dropping it would leave the
    caller's object empty while the model ran as if from a new prompt."""
    if not isinstance(cache, NSACache):
        raise ValueError(
            f"NSA needs an NSACache, got {type(cache).__name__}: it holds NSA's compressed and window state beside the "
            "keys. Pass NSACache(model.config) (from modeling_nsa import NSACache) or no cache (use_cache=True "
            "builds one and returns it as past_key_values)."
        )
    cache.check_model(config)


class NSAModel(NSAPreTrainedModel):
    def __init__(self, config: NSAConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([NSADecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = NSARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = NSARotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _check_inputs(self, input_ids, inputs_embeds, attention_mask, position_ids, past_len):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:2])
        if len(shape) != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {shape}.")
        if shape[1] == 0:  # (generate() feeds the tokens past the cache's length: none where it holds the prompt)
            held = f"; the cache already holds {past_len} token(s)" if past_len else ""
            raise ValueError(f"the input has no tokens (shape {shape}){held}. A new prompt needs an empty cache: a new "
                             "NSACache(model.config) or cache.reset(); a continuation passes its new tokens.")
        if input_ids is not None and past_len == 0 and not torch.compiler.is_compiling():
            # One host sync per forward buys a clear message instead of a CUDA device assert. Not on steps
            # after a cache (generation feeds back the model's own tokens): no sync per generated token.
            low, high = int(input_ids.min()), int(input_ids.max())
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(
                    f"input_ids contain {low if low < 0 else high}, outside the vocabulary [0, {self.config.vocab_size}); "
                    "check the tokenizer matches the model (config.vocab_size)."
                )
        if attention_mask is not None and past_len is None:  # a static cache's step: the last column is the token's
            if attention_mask.dim() != 2 or attention_mask.shape[0] != shape[0]:
                raise ValueError(f"attention_mask must be 2-D (batch, ...), got {tuple(attention_mask.shape)}.")
        elif attention_mask is not None:
            expected = (shape[0], past_len + shape[1])
            if attention_mask.dim() != 2 or tuple(attention_mask.shape) not in {expected, shape}:
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}; with {past_len} cached and {shape[1]} new "
                    f"tokens it must be 2-D (batch, past + seq_len) = {expected}."
                )
        if position_ids is not None and position_ids.shape[-1] != shape[1]:
            raise ValueError(f"position_ids has length {position_ids.shape[-1]} but the input has {shape[1]} tokens.")
        return shape

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: NSACache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        cache: NSACache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Documents in a packed row: a document starts where `position_ids` is 0 (transformers' convention) or
        at `cu_seqlens` (one flattened row). Padding: `attention_mask` zeros; the first token after padding starts
        a document. Tokens appended to a filled cache follow the same rules: they continue each row's last
        document unless one starts a new one."""
        past_key_values = cache if cache is not None else past_key_values  # (transformers >= 5.24's name)
        # Training forwards build no cache unless asked: the cache is for generation.
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if past_key_values is not None:
            check_cache(past_key_values, self.config)
        # the backward replays each checkpointed layer, whose cache update would then store its keys twice; without
        # gradients (generating from a model in training mode) there is no replay, and the cache works as in eval
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            if past_key_values is not None:
                raise ValueError(
                    "NSA: a cache (past_key_values/cache) in a training forward with gradient checkpointing: the "
                    "backward replays each layer, which would store its keys in the cache a second time. Pass no "
                    "cache, run the forward under torch.no_grad() or model.eval(), or call "
                    "model.gradient_checkpointing_disable()."
                )
            if use_cache:
                _log_once("NSA: use_cache=True does not combine with gradient checkpointing in training (with "
                          "gradients); no cache is built.")
            use_cache = False
        if use_cache and past_key_values is None:
            past_key_values = NSACache(self.config)
        static_step = past_key_values is not None and past_key_values.static and past_key_values.decoding
        # (a static cache's step reads no host length: the compiled step would be recompiled at every token)
        past_len = None if static_step else past_key_values.get_seq_length() if past_key_values is not None else 0
        batch, num_new = self._check_inputs(input_ids, inputs_embeds, attention_mask, position_ids, past_len)
        if attention_mask is not None and attention_mask.shape[1] == num_new and (past_len or 0) > 0:
            raise ValueError(
                f"attention_mask covers only the {num_new} new tokens; with a cache of {past_len} it must cover "
                f"past + new = {past_len + num_new}."
            )
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        device = inputs_embeds.device

        cu_seqlens = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))  # varlen packing, one flattened row
        if cu_seqlens is not None:
            if batch != 1 or past_key_values is not None:
                raise ValueError(
                    f"cu_seqlens describes one flattened row without a cache; got batch={batch}, "
                    f"cache={'yes' if past_key_values is not None else 'no'}. Pass use_cache=False and input_ids of shape (1, T)."
                )
            if not torch.compiler.is_compiling():  # (a host read: checked eagerly only)
                _check_cu_seqlens(cu_seqlens, num_new)
            doc_pos = document_positions_from_cu_seqlens(cu_seqlens, num_new, device)
        elif past_key_values is not None:
            doc_pos = past_key_values.append_positions(position_ids, attention_mask, batch, num_new, device)  # (B, Tk)
        else:
            doc_pos = document_positions(position_ids, attention_mask, batch, num_new, device)  # (B, T)
        # With a cache only the new tokens and the compressed tokens they complete are rotated, not all Tk
        # (cos/sin of every cached position would cost O(Tk) per generated token).
        rope_span = doc_pos.shape[1] if past_key_values is None else num_new + self.config.cmp_block_size - 1
        # (a static cache's step: doc_pos is the whole fixed-size buffer; the token sits at the cursor)
        rope_positions = doc_pos.index_select(1, past_key_values.cursor) if static_step else doc_pos[:, -rope_span:]
        position_embeddings = self.rotary_emb(rope_positions, inputs_embeds.dtype)

        single_document = position_ids is None and attention_mask is None and cu_seqlens is None and past_key_values is None
        output_hidden_states = kwargs.get("output_hidden_states")
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        output_attentions = kwargs.get("output_attentions")
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        all_attentions, recorders = None, []
        if output_attentions and self.config.attention_mode == "nsa":
            _log_once("NSA: output_attentions=True returns no attention weights (attentions=None): the three branches "
                      "never form a (T x T) attention matrix.")
        elif output_attentions and (self.config._attn_implementation or "sdpa") != "eager":
            _log_once(f"NSA dense mode: output_attentions=True returns attention weights with attn_implementation="
                      f"'eager' only (attentions=None with {self.config._attn_implementation or 'sdpa'!r}); load or "
                      "build the model with attn_implementation='eager' for them.")
        elif output_attentions:  # each layer's softmax weights (B, H, Tq, Tk), the second output of its attention
            all_attentions = []
            recorders = [layer.self_attn.register_forward_hook(lambda module, args, out: all_attentions.append(out[1]))
                         for layer in self.layers]  # fmt: skip
        hidden_states = inputs_embeds
        all_hidden_states = (inputs_embeds,) if output_hidden_states else None  # each layer's input, then the output
        dense_attention = None  # the documents as dense mode's attention function takes them, for every layer
        compressed = None  # NSA's compressed tokens' layout, for every layer (a forward over whole rows)
        if self.config.attention_mode == "dense":
            query_end = past_key_values.cursor if static_step else None
            dense_attention = dense_attention_kwargs(self.config._attn_implementation or "sdpa", doc_pos, num_new,
                                                     query_end, single_document, inputs_embeds.dtype)  # fmt: skip
        elif past_key_values is None or (past_key_values.static and not static_step):  # no cache, a static prompt
            compressed = compressed_layout(doc_pos, NSAParams.from_config(self.config), *position_embeddings)
        try:
            # the first config.num_hidden_layers layers, as Llama: generate(assistant_early_exit=N) drafts with the
            # first N (it sets the count for its draft calls, and its draft cache holds N layers)
            for layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states = layer(hidden_states, doc_pos, position_embeddings, past_key_values=past_key_values,
                                      single_document=single_document, dense_attention=dense_attention,
                                      compressed=compressed)  # fmt: skip
                if output_hidden_states:
                    all_hidden_states += (hidden_states,)
        finally:
            for recorder in recorders:
                recorder.remove()
        if past_key_values is not None:
            past_key_values.advance(num_new)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:  # transformers' convention: num_hidden_layers + 1, the last one normalized
            all_hidden_states = all_hidden_states[:-1] + (hidden_states,)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, hidden_states=all_hidden_states,
                                       attentions=None if all_attentions is None else tuple(all_attentions),
                                       **{CACHE_NAME: past_key_values if use_cache else None})  # fmt: skip


class NSAForCausalLM(NSAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: NSAConfig):
        super().__init__(config)
        self.model = NSAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode=None, batch_size=None, max_cache_length=0
    ):
        """generate() gets an NSACache (selection/window/compressed state), never a DynamicCache, with room
        for generate()'s max_length reserved (no step copies the cache). cache_implementation="static": fixed-size
        buffers, and generate() compiles the decoding steps on a GPU (transformers' compile_config: CUDA graphs)."""
        user_cache = model_kwargs.get(CACHE_NAME)
        if user_cache is not None:  # as transformers' own: conflicting arguments refused, the cache marked as the
            # caller's (generate() then keeps it consistent with the tokens it returns)
            if generation_config.cache_implementation is not None:
                raise ValueError(
                    f"generate(): pass either cache_implementation={generation_config.cache_implementation!r} or a "
                    f"cache ({CACHE_NAME}=), not both: the cache given is used as it is."
                )
            check_cache(user_cache, self.config)  # (a legacy tuple, a DynamicCache, another model's cache: refused)
            user_cache._is_user_defined = True
            return
        if generation_config.use_cache is not False:
            static = generation_config.cache_implementation == "static"
            if static and getattr(generation_config, "max_cache_len", None) is not None:  # (transformers >= 5.2x)
                # sized for the longest call expected, as transformers' static caches: the same shapes every call
                max_cache_length = max(max_cache_length or 0, generation_config.max_cache_len)
            if generation_config.cache_implementation not in (None, "static"):
                _log_once(
                    f"NSA: generate() uses NSACache (compressed, selection and window state); "
                    f"cache_implementation={generation_config.cache_implementation!r} is ignored "
                    "(NSA supports 'static': fixed-size buffers, compiled decoding)."
                )
            cache = NSACache(self.config, max_cache_len=max_cache_length or 0, static=static)
            if getattr(generation_config, "is_assistant", False):  # an assistant's drafts are taken back: record them
                cache.activate_past_recording()
            model_kwargs[CACHE_NAME] = cache

    def init_continuous_batching(self, *args, **kwargs):
        """transformers' continuous batching (generate_batch(), generate(cache_implementation="paged"), `transformers
        serve` with continuous batching, all through this method) runs a model on its paged cache, which holds keys
        and values only: none of NSA's compressed tokens, selection or window state. Refused here, once, before a
        request is queued; without this each request would fail on its own inside the batching loop."""
        raise NotImplementedError(
            "NSA does not support transformers' continuous batching (generate_batch(), "
            "generate(cache_implementation='paged'), init_continuous_batching(), `transformers serve` with continuous "
            "batching): its paged cache holds keys and values only, not NSA's compressed tokens and selection state. "
            "Batch prompts with generate() instead (left padding: tokenizer.padding_side = 'left'), or pass "
            "cache_implementation='static' for compiled decoding steps on a GPU."
        )

    def create_masks_for_generate(self, attention_mask=None, past_key_values=None, is_first_iteration=False, cache=None,
                                  **kwargs):
        """generate() asks for the mask of a compilable (static) cache's steps here. NSA needs no 4-D mask: the
        prompt's 2-D mask gives each row's padding once, and the cache keeps it in its positions; the steps after
        it get no mask (every generated token is real), so the compiled step sees the same inputs at every token."""
        past_key_values = cache if cache is not None else past_key_values
        if past_key_values is not None and past_key_values.static and past_key_values.decoding:
            return None
        return attention_mask

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: NSACache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """`labels` are the input ids (shifted inside `self.loss_function`); -100 is ignored. Pass
        `num_items_in_batch` to get a sum over tokens divided by that count (gradient accumulation)."""
        passed = ("cache", "cu_seq_lens_q", "cu_seqlens", "output_hidden_states", "output_attentions")
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,  # (the output's fields are read below, whatever config.return_dict says)
            **{key: kwargs[key] for key in passed if key in kwargs},
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions, **{CACHE_NAME: getattr(outputs, CACHE_NAME)})


NSAModel.register_for_auto_class("AutoModel")
NSAForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "NSACache",
    "NSAForCausalLM",
    "NSAModel",
    "NSAPreTrainedModel",
    "nsa_attention",
]
