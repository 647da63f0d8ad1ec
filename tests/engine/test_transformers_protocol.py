"""What the engine relies on in transformers 5.17.0, checked so an upgrade fails here, loudly, not in production.

The engine runs transformers' Qwen3.5 modules (weights, norms, projections, RoPE, MLP) in its own layer order
(`engine/model.py`).  That depends on module attribute names, two helper functions, and the numerics of the
decoder layers matching transformers' own forward.
"""
import inspect

import torch
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as m

from engine.model import _PrefixRecorder

PINNED = "5.17.0"


def test_transformers_is_the_pinned_release():
    assert transformers.__version__ == PINNED, (
        f"transformers {transformers.__version__} is installed; decider's engine/model.py is written against "
        f"{PINNED}'s Qwen3.5 modules. Re-check engine/model.py against the new modeling_qwen3_5.py, then update the pin.")


def test_module_attributes_the_engine_reads(eng):
    layer_types = set()
    for layer in eng.core.layers:
        layer_types.add(layer.block_type)
        assert hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm") and hasattr(layer, "mlp")
        if layer.block_type == "linear_attention":
            lin = layer.linear_attn
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
                         "out_proj", "conv_kernel_size", "conv_dim", "key_dim", "value_dim", "head_k_dim",
                         "head_v_dim", "num_k_heads", "num_v_heads", "activation"):
                assert hasattr(lin, name), f"Qwen3_5GatedDeltaNet lost {name!r}"
        else:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "head_dim", "scaling"):
                assert hasattr(layer.self_attn, name), f"Qwen3_5Attention lost {name!r}"
    assert layer_types == {"linear_attention", "full_attention"}, "the tiny model must hold both layer types"
    params = inspect.signature(m.torch_chunk_gated_delta_rule).parameters
    for name in ("initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "g", "beta"):
        assert name in params
    assert list(inspect.signature(m.apply_rotary_pos_emb).parameters)[:4] == ["q", "k", "cos", "sin"]


def test_layer_order_reproduces_transformers_forward(eng):
    """The engine's layer loop over a whole prompt equals transformers' own forward (no cache anywhere)."""
    ids = torch.randint(0, eng.cfg.vocab_size, (3, 57), generator=torch.Generator().manual_seed(0))
    fwd = eng.forward
    with torch.no_grad():
        want = eng.core(input_ids=ids, use_cache=False).last_hidden_state
        rows = []
        for row in ids:
            rec = _PrefixRecorder(len(row))
            rows.append(fwd.layers(row[None], torch.arange(len(row))[None], rec))
        got = eng.core.norm(torch.cat(rows))
    assert (got - want).abs().max().item() < 1e-4
