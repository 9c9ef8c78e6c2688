"""NSAConfig: a Llama-style decoder whose attention is Native Sparse Attention.

Symbols follow the paper (Yuan et al., arXiv 2502.11089, §3 and §4.1); the exact
function every code path computes is fixed in NSA_SPEC (README, "Semantics").
Defaults are the 125M reference model: 12 layers, hidden 768, 12 query heads,
2 KV heads (G = 6), head_dim 64, SwiGLU, RMSNorm, RoPE, GPT-2 vocab padded to 50304.
"""

import math

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig

ATTENTION_MODES = ("nsa", "dense")
NSA_BACKENDS = ("auto", "reference", "triton")
COMPRESSORS = ("mlp", "mean", "mean_mlp")
# the compressors with the paper's learnable φ (position embeddings and MLPs for K and V)
COMPRESSORS_WITH_MLP = ("mlp", "mean_mlp")
# NSA's branches in gate order (paper Eq. 5); kv_per_branch may name one of them (its own K/V set, the other two
# sharing one)
BRANCHES = ("cmp", "slc", "win")
# transformers' defaults, which NSA mode takes (and does not consult): "sdpa", and "eager" that output_attentions sets
NSA_MODE_ATTN_IMPLEMENTATIONS = (None, "sdpa", "eager")


def check_attn_implementation(attention_mode: str, attn_implementation) -> None:
    """attn_implementation chooses dense mode's attention function (transformers' attention interface). NSA mode
    computes attention with its own kernels (nsa_backend): it refuses a choice it would not use."""
    if attention_mode == "nsa" and attn_implementation not in NSA_MODE_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} applies to attention_mode='dense' (the dense baseline); "
            "attention_mode='nsa' computes its attention with the NSA kernels, chosen by nsa_backend ('auto', "
            "'triton' or 'reference'). Drop attn_implementation, or set attention_mode='dense'."
        )


@strict
class NSAConfig(PreTrainedConfig):
    r"""
    Configuration of an [`NSAForCausalLM`].

    Transformer fields are Llama's. NSA fields (paper symbol in brackets):

    - `cmp_block_size` [l] = 32: raw keys summarized by one compressed token (§3.3.1, Eq. 7).
    - `cmp_stride` [d] = 16: stride between compressed tokens; must divide l and l'.
    - `sel_block_size` [l'] = 64: selection block size (§3.3.2).
    - `sel_num_blocks` [n] = 16: selected blocks per query, forced blocks included.
    - `sel_init_blocks` = 1 / `sel_local_blocks` = 2: blocks always selected at the start of
      the document and at the query's own position (§4.1: "1 initial block and 2 local blocks").
    - `window_size` [w] = 512: sliding-window keys, the query itself included.
    - `kv_per_branch` = True: independent K/V per branch (§3.3.3); False shares one K/V. An ablation between
      them: "cmp", "slc" or "win" gives that branch a K/V set of its own and the other two one shared set.
    - `compressor` = "mlp": the paper's learnable φ; "mean" is the parameter-free average (fla's); "mean_mlp" is
      the average plus the paper's φ with its output layer started at zero (it begins as "mean").
    - `cmp_mlp_hidden_size` = 256: hidden width of φ (l*head_dim -> hidden -> head_dim).
    - `attention_mode` = "nsa"; "dense" is the same model with full causal attention (A/B baseline).
    - `head_dim` = 64, as the 125M model; None derives it as Llama does (hidden_size // num_attention_heads).
    - `training_seq_len` = None: the row length the model was last trained at, written by the trainer's export.
    - `nsa_backend` = "auto" (the Triton kernels on NVIDIA GPUs of compute capability 8.0+, the PyTorch
      reference elsewhere), "reference" or "triton".
    - `attn_implementation` (transformers' argument, also `from_pretrained(..., attn_implementation=...)`): dense
      mode's attention function, "sdpa" (default), "eager", "flex_attention", "flash_attention_2"/"_3" (where
      installed); packed documents reach each as it takes them. NSA mode refuses any but the defaults.

    ```python
    >>> from modeling_nsa import NSAConfig, NSAForCausalLM
    >>> model = NSAForCausalLM(NSAConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
    ...                                  num_key_value_heads=2, head_dim=32, intermediate_size=256))
    ```
    """

    model_type = "nsa"
    # the output's cache, which Trainer's evaluation must not take for logits: "cache" from transformers 5.24 on,
    # "past_key_values" before
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    vocab_size: int = 50304
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 2
    head_dim: int | None = 64  # None: hidden_size // num_attention_heads (Llama's rule), resolved at validation
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rope_theta: float | int = 10000.0  # an int (config.json files often say 500000) is stored as a float
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = True

    # NSA (paper §3, defaults from §4.1)
    cmp_block_size: int = 32
    cmp_stride: int = 16
    sel_block_size: int = 64
    sel_num_blocks: int = 16
    sel_init_blocks: int = 1
    sel_local_blocks: int = 2
    window_size: int = 512
    kv_per_branch: bool | str = True
    compressor: str = "mlp"
    cmp_mlp_hidden_size: int = 256

    attention_mode: str = "nsa"
    nsa_backend: str = "auto"
    # the row length the model was last trained at (the trainer's --seq-len, written at export): where
    # nsa_train.long_context starts marking lengths as extrapolation; None: not known
    training_seq_len: int | None = None

    def __post_init__(self, **kwargs):
        # transformers 5 spells RoPE as rope_parameters (rope_scaling before it): NSA's is plain RoPE, whose one
        # parameter is rope_theta, so those become rope_theta here and any scaling is refused
        for name in ("rope_scaling", "rope_parameters"):
            value = kwargs.pop(name, None)
            if value is not None:
                self._take_rope_parameters(name, value)
        super().__post_init__(**kwargs)
        self.validate_nsa()

    def _take_rope_parameters(self, name: str, value) -> None:
        rope_type = value.get("rope_type", value.get("type", "default")) if isinstance(value, dict) else None
        if rope_type != "default":
            raise ValueError(
                f"NSAConfig.{name}={value!r}: NSA's rotary embedding is plain RoPE (rope_type 'default'), with no "
                "scaling; set rope_theta (e.g. rope_theta=500000.0) instead."
            )
        self.rope_theta = value.get("rope_theta", self.rope_theta)

    def validate_nsa(self):
        """The one validation step; raises `ValueError` naming the values. __post_init__ runs it (construction and
        loading), NSAPreTrainedModel when a model is built (a field may have been set since), and, being a @strict
        class validator, `validate()` too (transformers calls it at save; it wraps the error)."""
        if self.head_dim is None:  # Llama's rule (a Llama config ported as it is); stored resolved, so saved as a number
            if (isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int)
                    and self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads == 0):
                self.head_dim = self.hidden_size // self.num_attention_heads
            else:
                raise ValueError(
                    f"head_dim=None derives head_dim as hidden_size // num_attention_heads, but hidden_size "
                    f"({self.hidden_size!r}) is not a multiple of num_attention_heads ({self.num_attention_heads!r}); "
                    "set head_dim (e.g. 64)."
                )
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "cmp_block_size", "cmp_stride",
            "sel_block_size", "sel_num_blocks", "window_size", "cmp_mlp_hidden_size",
        )  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"NSAConfig.{name} must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}); the group size G is their ratio."
            )
        if self.cmp_block_size % self.cmp_stride != 0:
            raise ValueError(
                f"cmp_stride (d={self.cmp_stride}) must divide cmp_block_size (l={self.cmp_block_size}); "
                "e.g. l=32, d=16."
            )
        if self.sel_block_size % self.cmp_stride != 0:
            raise ValueError(
                f"cmp_stride (d={self.cmp_stride}) must divide sel_block_size (l'={self.sel_block_size}); "
                "e.g. l'=64, d=16."
            )
        if self.sel_init_blocks < 0 or self.sel_local_blocks < 0:
            raise ValueError(
                f"sel_init_blocks ({self.sel_init_blocks}) and sel_local_blocks ({self.sel_local_blocks}) "
                "must be >= 0."
            )
        if self.sel_init_blocks + self.sel_local_blocks > self.sel_num_blocks:
            raise ValueError(
                f"sel_init_blocks + sel_local_blocks ({self.sel_init_blocks} + {self.sel_local_blocks}) must not "
                f"exceed sel_num_blocks (n={self.sel_num_blocks}): forced blocks take slots of the n."
            )
        if getattr(self, "rope_parameters", None) is not None:  # set after construction (config.rope_scaling = ... too)
            self._take_rope_parameters("rope_parameters", self.rope_parameters)
            del self.rope_parameters
        if isinstance(self.rope_theta, int) and not isinstance(self.rope_theta, bool):
            self.rope_theta = float(self.rope_theta)  # an int, given or from rope_parameters: stored as a float
        if (isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float))
                or not math.isfinite(self.rope_theta) or self.rope_theta <= 0):  # (NaN <= 0 is False)
            raise ValueError(f"rope_theta must be a finite number > 0 (RoPE's base, e.g. 10000.0), got {self.rope_theta}.")
        for name, low, example in (("rms_norm_eps", "> 0", "1e-6"), ("initializer_range", ">= 0", "0.02")):
            value = getattr(self, name)  # (a negative eps gives NaN, a negative std fails only when weights are drawn)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or (value <= 0 if low == "> 0" else value < 0)):  # fmt: skip
                raise ValueError(f"NSAConfig.{name} must be a finite number {low} (e.g. {example}), got {value!r}.")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}.")
        from transformers.activations import ACT2FN  # (the MLP's activation table; imported here: remote code too)

        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act must be one of transformers' activations (e.g. 'silu', the default; "
                             f"'gelu_pytorch_tanh'), got {self.hidden_act!r}.")
        if self.training_seq_len is not None and (not isinstance(self.training_seq_len, int)
                                                   or self.training_seq_len <= 0):  # fmt: skip
            raise ValueError(f"NSAConfig.training_seq_len must be a positive integer or None, got "
                             f"{self.training_seq_len!r}.")
        if not isinstance(self.kv_per_branch, bool) and self.kv_per_branch not in BRANCHES:
            raise ValueError(
                f"kv_per_branch must be True (a K/V set per branch), False (one shared set) or the branch with a set "
                f"of its own, one of {BRANCHES}; got {self.kv_per_branch!r}."
            )
        if self.compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {COMPRESSORS}, got {self.compressor!r}.")
        if self.attention_mode not in ATTENTION_MODES:
            raise ValueError(f"attention_mode must be one of {ATTENTION_MODES}, got {self.attention_mode!r}.")
        if self.nsa_backend not in NSA_BACKENDS:
            raise ValueError(f"nsa_backend must be one of {NSA_BACKENDS}, got {self.nsa_backend!r}.")
        check_attn_implementation(self.attention_mode, getattr(self, "_attn_implementation_internal", None))

    @property
    def kv_set_of_branch(self) -> dict[str, int]:
        """The K/V set each branch (cmp, slc, win) reads, numbered in that order of first use: the K/V projection's
        output is (sets, k/v, Hkv, D). Dense mode has one set (set 0), which its attention reads."""
        if self.attention_mode == "dense":
            return dict.fromkeys(BRANCHES, 0)
        own = self.kv_per_branch
        # the set each branch reads, named: its own, or the one set the others share
        names = [branch if own is True or branch == own else "shared" for branch in BRANCHES]
        order = list(dict.fromkeys(names))
        return {branch: order.index(name) for branch, name in zip(BRANCHES, names)}

    @property
    def num_kv_sets(self) -> int:
        """How many K/V sets the K/V projection holds: 3, 2 (kv_per_branch naming a branch) or 1 (shared, or dense)."""
        return max(self.kv_set_of_branch.values()) + 1

    @property
    def num_key_value_groups(self) -> int:
        """G: query heads sharing one KV head."""
        return self.num_attention_heads // self.num_key_value_heads


NSAConfig.register_for_auto_class()

__all__ = ["NSAConfig"]
