"""`optim.autocast=bfloat16`: the engine trains with bf16 matmuls and fp32 weights, grads and Adam state, close
to (not equal to) fp32; the fused head and plain-logits paths both run; each weight is cast to bf16 once per
`forward_backward`, bitwise the per-call casts; bad settings are ConfigErrors."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from rlhf.errors import ConfigError
from rlhf.platform import host_supports_bf16
from rlhf.testing.distributed import run_distributed
from rlhf.train.config import OptimConfig
from tests.train.helpers import save_tiny_llama, sft_batch


@contextlib.contextmanager
def _per_call_casts():
    """While open, autocast casts every weight at each use again (what the engine did before the weight cache)."""
    from rlhf.platform import device
    from rlhf.platform.compat import megatron_host

    proxy, cache = megatron_host._state["proxy"], device.autocast_weight_cache
    proxy.matmul, device.autocast_weight_cache = torch.matmul, lambda dtype: contextlib.nullcontext()
    try:
        yield
    finally:
        proxy.matmul, device.autocast_weight_cache = megatron_host._cast_once_matmul, cache


def _casts(step) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        step()
    return sum(event.count for event in profiler.key_averages() if event.key == "aten::_to_copy")


def _cache_rank(path: str) -> dict:
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.testing.engine_nll import sft_micro_batches, sft_step
    from tests.train.engine_world import _engine

    pgs = build_layout_groups(ParallelLayout(tp=1, pp=1, dp=1))
    engines = {name: _engine(path, pgs, lr=1e-3, autocast="bfloat16") for name in ("cached", "per_call")}
    out = {"losses": {name: [] for name in engines}, "casts": {name: [] for name in engines}}
    for step in range(2):
        tokens, mask = sft_batch(8, 16, seed=step)
        for name, engine in engines.items():
            batches = sft_micro_batches(tokens, mask, dp_rank=0, dp_size=1, num_micro_batches=2)
            with _per_call_casts() if name == "per_call" else contextlib.nullcontext():
                out["casts"][name].append(_casts(lambda: out["losses"][name].append(
                    sft_step(engine, batches, fused_head=step % 2 == 0).loss)))
    out["params_equal"] = all(torch.equal(a, b) for a, b in zip(engines["cached"].module.parameters(),
                                                                engines["per_call"].module.parameters()))
    return out


@pytest.mark.skipif(not host_supports_bf16(), reason="this CPU has no native bf16 matmuls (AVX-512-BF16/AMX)")
def test_weights_cast_once_per_step_bitwise_the_per_call_casts(tmp_path):
    out = run_distributed(_cache_rank, 1, save_tiny_llama(str(tmp_path)), timeout_s=300)[0]
    assert out["losses"]["cached"] == out["losses"]["per_call"]
    assert out["params_equal"]
    assert all(a < b for a, b in zip(out["casts"]["cached"], out["casts"]["per_call"])), out["casts"]


def _rank(path: str) -> dict:
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.testing.engine_nll import sft_micro_batches, sft_step
    from tests.train.engine_world import _engine

    pgs = build_layout_groups(ParallelLayout(tp=1, pp=1, dp=1))
    engines = {name: _engine(path, pgs, lr=1e-3, autocast=name) for name in ("none", "bfloat16")}
    out = {name: [] for name in engines}
    for step in range(3):
        tokens, mask = sft_batch(8, 16, seed=step)
        for name, engine in engines.items():
            batches = sft_micro_batches(tokens, mask, dp_rank=0, dp_size=1, num_micro_batches=2)
            out[name].append(sft_step(engine, batches, fused_head=step % 2 == 0).loss)
    bf16 = engines["bfloat16"]
    out["dtypes"] = sorted({str(p.dtype) for p in bf16.module.parameters()}
                           | {str(p.main_grad.dtype) for p in bf16.module.parameters()}
                           | {str(t.dtype) for s in bf16.optimizer.optimizer.state.values() for t in s.values()})
    with pytest.raises(ConfigError) as error:
        _engine(path, pgs, params_dtype=torch.bfloat16, autocast="bfloat16")
    out["bf16_params_error"] = str(error.value)
    return out


@pytest.mark.skipif(not host_supports_bf16(), reason="this CPU has no native bf16 matmuls (AVX-512-BF16/AMX)")
def test_bf16_autocast_trains_close_to_fp32_with_fp32_state(tmp_path):
    out = run_distributed(_rank, 1, save_tiny_llama(str(tmp_path)), timeout_s=300)[0]
    fp32, bf16 = out["none"], out["bfloat16"]
    assert all(abs(a - b) <= 2e-2 * abs(a) for a, b in zip(fp32, bf16)), (fp32, bf16)
    assert fp32 != bf16  # the matmuls really ran in bf16
    assert out["dtypes"] == ["torch.float32"]  # weights, grads and Adam moments (and step) stay fp32
    assert out["bf16_params_error"] == ("optim.autocast='bfloat16' needs fp32 weights (model.dtype=float32), got "
                                        "torch.bfloat16; set optim.autocast=none")


def test_unknown_autocast_is_a_config_error():
    with pytest.raises(ConfigError, match=re.escape("optim.autocast='fp16' is not one of none, bfloat16")):
        OptimConfig(autocast="fp16")
