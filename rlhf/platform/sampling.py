"""The native sampler's inverse-CDF draw on the kernel library's C pass (`rlhf.kernels.cpu_sample`): fp32 logits on
a CPU where the library builds; None elsewhere (the sampler's torch ops).

torch's draw is ~6 passes over [rows, vocab] (softmax's three, the block sums, the gather, the log); the kernel
reads each row twice (its maximum, then the exponentials summed per block, by a polynomial exp in plain vector
arithmetic) and never writes probabilities: SmolLM2, 32 x 49152 logits, one thread: 0.69 -> 0.30 ms a decode step
(0.40 with libmvec's expf; 65 -> 30 ms over a 64-token rollout). Same draw rule (two-level, blocks of 256),
other summation order: a token differs from torch's only where the uniform number lies within rounding of a
boundary of the cumulative mass. Single-threaded at any torch thread count, so a seed draws the same tokens
whatever the threads."""

from __future__ import annotations

import torch


def draw_kernel(logits_kv: torch.Tensor):
    """The kernel (`Sample.draw`) for these logits, or None."""
    if logits_kv.device.type != "cpu" or logits_kv.dtype != torch.float32 or logits_kv.dim() != 2:
        return None
    from rlhf.kernels.cpu_sample import load

    return load()
