"""Shims so the mirror's (5.16.0.dev0) model test files run against transformers 5.24.0.

Loaded as a pytest plugin (-p upstream_shims) before any test module imports.
Identical in all three runs.
"""

import transformers.testing_utils as _tu

# causal_lm_tester.py / multimodal_tester.py (mirror) import this default table;
# 5.24.0's testing_utils no longer defines it.  Copied from the mirror's testing_utils.
if not hasattr(_tu, "_TEXT_MODEL_TESTER_DEFAULTS"):
    _tu._TEXT_MODEL_TESTER_DEFAULTS = {
        "batch_size": 13,
        "seq_length": 7,
        "is_training": True,
        "use_input_mask": True,
        "use_labels": True,
        "vocab_size": 99,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 32,
        "hidden_act": "gelu",
        "max_position_embeddings": 512,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "expert_interval": 1,
        "moe_layer_start_index": 0,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 36,
        "shared_expert_gate": True,
        "moe_num_shared_experts": 2,
        "num_experts_per_tok": 2,
        "num_experts": 8,
    }
