"""The op table's grouping and the model-shape FLOP formulas, on hand-made cases (no timing)."""

from __future__ import annotations

import pytest

from rlhf.models.spec import ModelSpec
from rlhf.profiling.ops import OpTime, decode_flops, matmul_params, op_group, op_table, train_flops


def _spec(**overrides) -> ModelSpec:
    values = dict(model_type="llama", vocab_size=100, hidden_size=8, ffn_hidden_size=16, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, qkv_bias=False,
                  tie_embeddings=False, rope_theta=1e4, rope_scaling=None, max_position_embeddings=32,
                  initializer_range=0.02)
    return ModelSpec(**(values | overrides))


def test_flops_from_the_model_shape():
    spec = _spec()
    # per layer: q (8x8) + k (8x4) + v (8x4) + o (8x8) = 192, MLP 3 * 8 * 16 = 384; LM head 8 * 100
    assert matmul_params(spec) == 2 * (192 + 384) + 800
    # 10 tokens in sequences of 5: 6 N per token + 12 * layers * heads * head_dim * seq
    assert train_flops(spec, 10, 5) == 10 * (6 * 1952 + 12 * 2 * 2 * 4 * 5)
    # 3 decoded tokens over a mean context of 7: 2 N + 4 * layers * heads * head_dim * context
    assert decode_flops(spec, 3, 7.0) == 3 * (2 * 1952 + 4 * 2 * 2 * 4 * 7.0)


@pytest.mark.parametrize("name, under_optimizer, group", [
    ("aten::mm", False, "gemm"), ("aten::addmm", False, "gemm"), ("aten::bmm", False, "gemm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", False, "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", False, "attention"),
    ("aten::mul", False, "elementwise"), ("aten::copy_", False, "elementwise"), ("aten::fill_", False, "elementwise"),
    ("aten::_log_softmax", False, "elementwise"), ("aten::broadcast_tensors", False, "framework"),
    ("aten::mul", True, "optimizer"), ("aten::_foreach_mul_", False, "optimizer"),
    ("Optimizer.step#AdamW.step", False, "optimizer"),
    ("gloo:all_reduce", False, "communication"), ("c10d::allreduce_", False, "communication"),
    ("aten::view", False, "framework"), ("aten::empty_strided", False, "framework"), ("aten::t", False, "framework"),
    ("aten::tanh", False, "elementwise"), ("autograd::engine::evaluate_function: MmBackward0", False, "framework"),
    ("forward_step", False, "framework"),
])
def test_op_groups(name, under_optimizer, group):
    assert op_group(name, under_optimizer) == group


def test_op_table_totals_top_rows_and_untracked_time():
    events = [OpTime("aten::mm", 400.0), OpTime("aten::mm", 200.0), OpTime("aten::mul", 100.0),
              OpTime("aten::mul", 50.0, under_optimizer=True), OpTime("aten::view", 50.0)]
    table = op_table(events, wall_s=0.001, top=2)
    assert table["untracked_s"] == pytest.approx(0.0002)
    shares = {group: value["share"] for group, value in table["groups"].items()}
    assert shares == pytest.approx({"gemm": 0.6, "attention": 0.0, "elementwise": 0.1, "optimizer": 0.05,
                                    "communication": 0.0, "framework": 0.25})
    assert [(row["op"], row["group"], row["calls"]) for row in table["top"]] == [("aten::mm", "gemm", 2),
                                                                               ("aten::mul", "elementwise", 1)]
    assert table["top"][0]["self_s"] == pytest.approx(0.0006)
