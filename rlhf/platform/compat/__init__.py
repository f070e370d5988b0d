"""The one door to private names of torch, megatron-core and vLLM: one module per dependency (`torch`,
`megatron`, `vllm`), each headed by the version it is pinned to and every touch-point it holds.

`tests/platform/test_compat_door.py` fails when a module elsewhere reads a private name of theirs, or when a pin
changes without the matching header.
"""
