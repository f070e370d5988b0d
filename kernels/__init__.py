"""Kernels behind the platform door, installed as `rlhf.kernels`: GPU (Triton) and CPU (C, built with gcc on first
use: decode attention, bf16 norm and prefill RoPE, the fp32 decode GEMM, one shared object); each has a torch
reference path that the tests compare it with."""
