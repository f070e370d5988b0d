"""Test helpers shipped with the package (multi-process runner), reused by tests and benchmarks."""
