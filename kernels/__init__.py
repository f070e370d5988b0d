"""Kernels behind the platform door, installed as `rlhf.kernels`: GPU (Triton) and CPU (C, built with gcc on first
use: decode attention, the norms and the prefill RoPE, the fp32 decode GEMM, SwiGLU, training's RMSNorm backward and
packed causal attention, one shared object); each has a torch reference path that the tests compare it with."""
