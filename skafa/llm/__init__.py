"""Everything that reads a language model: loading, decoder sites, prompts and reads,
the activation cache, attention kernels, cost models and the extraction transformer.

This is the only subpackage that imports torch and transformers (lazily, on first use).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._attention import (
    BANDED_SDPA,
    banded_sdpa_attention_forward,
    banded_sliding_window_attention,
    has_sliding_window,
)
from ._cache import (
    DEFAULT_MEMORY_BYTES,
    ActivationCache,
    MemoryLRU,
    activation_key,
    conversation_content,
    shared_memory_cache,
)
from ._cost import (
    forward_flops,
    layer_parameters,
    measure_throughput,
)
from ._extraction import (
    SiteReader,
    TurnActivationTransformer,
    extract_activations,
)
from ._models import (
    SMOLLM2_FILE,
    ModelHandle,
    ModelSpec,
    clear_model_cache,
    context_length,
    load_model,
    model_fingerprint,
    model_identity,
    register_model,
    registered_models,
    resolve_model_spec,
    smollm2_available,
    smollm2_path,
    unregister_model,
    verify_saved_model,
)
from ._prompt import (
    DEFAULT_INSTRUCTION,
    DEFAULT_SYSTEM,
    PROMPT_FORMAT_VERSION,
    READS,
    Encoding,
    PromptPlan,
    PromptTemplate,
    check_fits,
    encode,
    plan,
    template_uses_date,
)
from ._sites import (
    DecoderLayout,
    all_sites,
    decoder_layout,
    parse_site,
    parse_site_spec,
    site_depth,
    stride_sites,
    validate_sites,
)

__all__ = [
    "ActivationCache",
    "BANDED_SDPA",
    "DEFAULT_INSTRUCTION",
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_SYSTEM",
    "DecoderLayout",
    "Encoding",
    "MemoryLRU",
    "ModelHandle",
    "ModelSpec",
    "PROMPT_FORMAT_VERSION",
    "PromptPlan",
    "PromptTemplate",
    "READS",
    "SMOLLM2_FILE",
    "SiteReader",
    "TurnActivationTransformer",
    "activation_key",
    "all_sites",
    "banded_sdpa_attention_forward",
    "banded_sliding_window_attention",
    "check_fits",
    "clear_model_cache",
    "context_length",
    "conversation_content",
    "decoder_layout",
    "encode",
    "extract_activations",
    "forward_flops",
    "has_sliding_window",
    "layer_parameters",
    "load_model",
    "measure_throughput",
    "model_fingerprint",
    "model_identity",
    "parse_site",
    "parse_site_spec",
    "plan",
    "register_model",
    "registered_models",
    "resolve_model_spec",
    "shared_memory_cache",
    "site_depth",
    "smollm2_available",
    "smollm2_path",
    "stride_sites",
    "template_uses_date",
    "unregister_model",
    "validate_sites",
    "verify_saved_model",
]
