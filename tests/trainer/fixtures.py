"""A tiny char-level Llama and a reasoning-gym chain_sum dataset, made locally for trainer tests."""

from __future__ import annotations

from pathlib import Path

from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.data.make import MakeConfig, make_dataset
from rlhf.models.init import InitModelConfig, init_hf_model


def make_tiny_setup(root: Path, num_train: int = 64, num_val: int = 16) -> dict[str, str]:
    tokenizer = build_char_tokenizer()
    model = init_hf_model(InitModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                          intermediate_size=64, max_position_embeddings=64), tokenizer,
                          root / "model")
    task = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    train = make_dataset(MakeConfig(task="chain_sum", num_samples=num_train, seed=1, prompt_format="expression",
                                    task_config=task), root / "train.jsonl")
    val = make_dataset(MakeConfig(task="chain_sum", num_samples=num_val, seed=10_000_000,
                                  prompt_format="expression", task_config=task), root / "val.jsonl")
    assert train and val
    return {"model": str(model), "train": str(root / "train.jsonl"), "val": str(root / "val.jsonl")}
