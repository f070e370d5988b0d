"""GPU kernels (Triton), installed as `rlhf.kernels`; each has a torch reference path the CPU tests check."""
