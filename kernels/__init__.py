"""Kernels behind the platform door, installed as `rlhf.kernels`: GPU (Triton) and CPU (C, built with gcc on first
use); each has a torch reference path that the tests compare it with."""
