"""The native engine in bf16 on CPU: oneDNN-packed bf16 weights and the fused bf16 decode-attention kernel, with
rollout logprobs close to the fp32 training forward's and the same as the bf16 torch reference path's."""

import shutil

import torch

from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import PromptBatch
from rlhf.testing.distributed import run_distributed
from rlhf.testing.tiny_models import tiny_hf_model

PROMPTS = [[5, 17, 33, 8, 90, 4, 61], [9, 40], [71, 3, 3, 3, 12, 60, 11, 23, 54, 7, 99], [44]]
SAMPLED = SamplingParams(max_new_tokens=16, temperature=1.0, n=2, seed=5, ignore_eos=True)


def _fp32_logprobs(path, rollouts):
    """Each rollout's response logprobs from the fp32 training forward (megatron model, `token_logprobs`)."""
    from rlhf.models.forward import token_logprobs
    from tests_native_helpers import native_engine

    _, model, pgs = native_engine(path, max_batch_size=1, max_seq_len=8)
    rows = []
    with torch.no_grad():
        for row in range(rollouts.num_rollouts):
            prompt, response = PROMPTS[int(rollouts.prompt_index_r[row])], rollouts.response(row)
            tokens = torch.tensor([prompt + response])
            logits = model.eval()(tokens, torch.arange(tokens.shape[1])[None], None)
            rows.append(token_logprobs(logits[:, :-1], tokens[:, 1:], pgs.tp, 101)[0, len(prompt) - 1:])
    return torch.stack(rows)


def _bf16_world(path):
    from rlhf.platform import linear
    from tests_native_helpers import native_engine

    linear.MIN_PACKED_NUMEL = 0  # the tiny model's weights are below both packing thresholds
    fast, _, _ = native_engine(path, max_batch_size=8, max_seq_len=32, dtype=torch.bfloat16)
    reference, _, _ = native_engine(path, max_batch_size=8, max_seq_len=32, dtype=torch.bfloat16,
                                    pack_weights=False, fused_kernels=False)
    batch = PromptBatch.from_token_lists(PROMPTS)
    rollouts = fast.generate(batch, SAMPLED)
    layer = fast.decoder.layers[0]
    packs = linear.ONEDNN_PACKING and linear.ONEDNN_BF16  # oneDNN's bf16 kernels on this CPU (AMX, AVX512)
    assert fast.cache.dtype == torch.bfloat16
    assert (layer.qkv.packed is not None) == (layer.swiglu.fused is None) == packs
    assert (fast.decoder.fused_attention is not None) == (shutil.which("gcc") is not None)
    assert rollouts.response_logprobs_rt.dtype == torch.float32
    error_rt = (rollouts.response_logprobs_rt - _fp32_logprobs(path, rollouts)).abs()
    same = reference.generate(batch, SAMPLED)
    assert reference.decoder.fused_attention is None and reference.decoder.layers[0].qkv.packed is None
    # The two bf16 paths round differently, so a sampled token may flip where the draw lands within their gap
    # (host-dependent: oneDNN picks AMX, AVX512-BF16 or AVX2 kernels); each row is compared up to its first flip.
    common_r = [_common_prefix(rollouts.response(row), same.response(row)) for row in range(rollouts.num_rollouts)]
    gap_rt = (same.response_logprobs_rt - rollouts.response_logprobs_rt).abs()
    gap = max((float(gap_rt[row, :n].max()) for row, n in enumerate(common_r) if n), default=0.0)
    return float(error_rt.max()), float(error_rt.mean()), sum(common_r), int(rollouts.response_lengths_r.sum()), gap


def _common_prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_bf16_rollout_logprobs_track_the_fp32_forward(tmp_path):
    tiny_hf_model("qwen2", seed=3).save_pretrained(tmp_path)
    max_error, mean_error, common, total, path_gap = run_distributed(_bf16_world, 1, str(tmp_path),
                                                                     timeout_s=300)[0]
    # bf16 weights and activations: measured max 0.035, mean 0.004, paths 0.029 apart (fp32 engines: 1e-5)
    assert max_error < 0.1 and mean_error < 0.02, (max_error, mean_error)
    # the fast path samples what the bf16 torch path samples (measured: every token, on an AMX host)
    assert common >= total // 2, (common, total)
    assert path_gap < 0.05, path_gap
