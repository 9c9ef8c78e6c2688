"""Native Sparse Attention as a transformers model: `NSAConfig`, `NSAForCausalLM`, `NSAModel`, `NSACache`."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_nsa import NSAConfig
from .modeling_nsa import NSAForCausalLM, NSAModel, NSAPreTrainedModel, nsa_attention
from .nsa_cache import NSACache
from .nsa_layout import NSAParams
from .nsa_reference import nsa_attention_reference

# Auto* classes resolve model_type "nsa" when this package is importable; checkpoints also carry
# the code (auto_map) so they load with trust_remote_code=True where it is not.
AutoConfig.register("nsa", NSAConfig, exist_ok=True)
AutoModel.register(NSAConfig, NSAModel, exist_ok=True)
AutoModelForCausalLM.register(NSAConfig, NSAForCausalLM, exist_ok=True)

__all__ = [
    "NSACache",
    "NSAConfig",
    "NSAForCausalLM",
    "NSAModel",
    "NSAParams",
    "NSAPreTrainedModel",
    "nsa_attention",
    "nsa_attention_reference",
]
