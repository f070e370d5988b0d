"""The native engine's decode step as one platform call, where the platform has one (`platform.fused_decode_step`).

A decode step of a small model is bound by its calls: the tiny models' whole layer computes in less time than its
~10 op calls take. The fused step runs embedding, every layer, the final norm and the LM head in one call on the
same kernels the per-op path uses (`Decoder.decode`), so its logits are the same bit for bit where the per-op path
also runs those kernels (weights packed for the decode GEMM). It covers dense layers without tensor parallelism;
routed (MoE) layers, TP, other dtypes and devices keep the per-op path.
"""

from __future__ import annotations

import torch

from rlhf import platform
from rlhf.platform import huge_pages
from rlhf.platform.linear import PreparedLinear, decode_gemm
from rlhf.rollout.native.params import DecoderGeometry, DecoderParams


def build_fused_step(params: DecoderParams, geometry: DecoderGeometry, prepared: tuple, output: PreparedLinear,
                     rope_t2d: torch.Tensor, tp_size: int):
    """The decode step of these weights in one call (`rlhf.kernels.cpu_decode_stack.DecodeStack`), or None where it
    does not apply. `prepared` is the Decoder's prepared layers: their decode-GEMM copies are reused, weights they
    did not pack (small ones) are packed here."""
    kernel = platform.fused_decode_step(params.embedding.dtype, params.embedding.device)
    if (kernel is None or tp_size != 1 or any(layer.moe is not None for layer in params.layers)
            or len({layer.fc1_weight.shape for layer in params.layers}) != 1):
        return None
    gemm = decode_gemm(params.embedding)
    if gemm is None:
        return None
    from rlhf.kernels.cpu_decode_stack import DecodeStack, StackLayer

    def packed(linear: PreparedLinear | None, weight: torch.Tensor) -> torch.Tensor:
        if linear is not None and linear.gemm_packed is not None:
            return linear.gemm_packed
        return gemm.pack(weight, huge_pages.empty(gemm.packed_numel(weight)))

    layers = []
    for layer, ready in zip(params.layers, prepared):
        swiglu_linear = ready.swiglu.decode if ready.swiglu is not None else None
        layers.append(StackLayer(input_norm=layer.input_norm.contiguous(), qkv=packed(ready.qkv, layer.qkv_weight),
                                 qkv_bias=None if layer.qkv_bias is None else layer.qkv_bias.contiguous(),
                                 q_norm=None if layer.q_norm is None else layer.q_norm.contiguous(),
                                 k_norm=None if layer.k_norm is None else layer.k_norm.contiguous(),
                                 proj=packed(ready.proj, layer.proj_weight), mlp_norm=layer.mlp_norm.contiguous(),
                                 fc1=packed(swiglu_linear, layer.fc1_weight), fc2=packed(ready.fc2, layer.fc2_weight)))
    return DecodeStack(kernel, layers, embedding=params.embedding.contiguous(), rope=rope_t2d.contiguous(),
                       final_norm=params.final_norm.contiguous(), head=packed(output, params.output),
                       vocab_rows=params.output.shape[0], hidden=geometry.hidden_size, groups=geometry.num_groups,
                       heads=geometry.num_heads // geometry.num_groups, head_dim=geometry.head_dim,
                       ffn=params.layers[0].fc1_weight.shape[0] // 2, eps=geometry.eps)
