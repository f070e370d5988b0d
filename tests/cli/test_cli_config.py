"""`rlhf config --print` shows the resolved tree a run would use; `--reference` prints the reference page, or
writes it to the path given."""

from __future__ import annotations

import json

import pytest
import yaml

from rlhf.cli.main import main
from rlhf.config import from_dict, load_config
from rlhf.orchestration.schema import RlhfConfig
from rlhf.config.reference import render


def test_print_is_the_resolved_config(capsys):
    args = ["--config", "configs/tiny_cpu.yaml", "mesh.rollout.tp=2", "actor.optim.lr=3e-6"]
    assert main(["config", "--print", *args]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert from_dict(RlhfConfig, printed) == load_config(RlhfConfig, args[1], args[2:])
    assert printed["mesh"]["rollout"]["tp"] == 2 and printed["sft"]["steps"] == 100  # defaults filled in


def test_print_names_a_bad_key(capsys):
    assert main(["config", "trainer.total_step=3"]) == 2
    assert capsys.readouterr().err == ("rlhf config: error: unknown config key 'trainer.total_step'; "
                                       "did you mean 'total_steps'?\n")


def test_reference_writes_the_page(tmp_path, capsys):
    out = tmp_path / "config.md"
    assert main(["config", "--reference", str(out)]) == 0
    assert out.read_text() == render(RlhfConfig) and capsys.readouterr().out == f"wrote {out}\n"


def test_reference_without_a_path_prints_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "--reference"]) == 0
    assert capsys.readouterr().out == render(RlhfConfig) and list(tmp_path.iterdir()) == []


QUICK_SIZES = ["data.prompts_per_step=2", "sampling.n=4", "sampling.max_new_tokens=32", "actor.micro_batch_size=4"]


@pytest.fixture(scope="module")
def newcomer_inputs(tmp_path_factory):
    """A tiny char-level Llama (128 positions) and a 6-row gsm8k-style JSONL, as a new user's own data."""
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    root = tmp_path_factory.mktemp("newcomer")
    model = init_hf_model(InitModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                          intermediate_size=64, max_position_embeddings=128),
                          build_char_tokenizer("0123456789abcdefghijklmnopqrstuvwxyz +-=#?.,"), root / "model")
    rows = [{"data_source": "openai/gsm8k", "prompt": f"tom has {i} apples and gets 2 more. how many? ",
             "reward_model": {"ground_truth": str(i + 2)}} for i in range(6)]
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"model": str(model), "train": str(root / "train.jsonl"), "root": root}


def test_check_lists_every_problem_of_the_ppo_recipe_at_the_quickstart_sizes(newcomer_inputs, capsys):
    """The PPO recipe at the quickstart's quick sizes on 2 ranks: both roles' splits and both warmups, in one go
    (each used to fail 10-30 s into its own launch)."""
    paths = newcomer_inputs
    argv = ["config", "--check", "--world", "2", "--config", "configs/recipes/ppo_critic.yaml",
            f"model.path={paths['model']}", f"data.train_files={paths['train']}", *QUICK_SIZES,
            "trainer.total_steps=2", f"run.output_dir={paths['root'] / 'runs'}"]
    rows = ["actor.max_tokens_per_microbatch=0", "critic.max_tokens_per_microbatch=0"]  # packed: any rows a rank
    assert main(argv + rows) == 2
    split = ("{role}: 8 rollouts per step (data.prompts_per_step=2 x sampling.n=4) must split into "
             "{role}.mini_batches=2 x dp=2 x micro-batches of {role}.micro_batch_size=4; make 2*2*4 divide 8")
    warmup = ("{role}.optim.warmup_steps=10 must be < the {role}'s 8 optimizer steps (trainer.total_steps=2 x "
              "{role}.epochs=2 x {role}.mini_batches=2); lower {role}.optim.warmup_steps or raise trainer.total_steps")
    assert capsys.readouterr().err == (
        "rlhf config: error: 4 problems in the config:\n"
        f"  1. {split.format(role='actor')}\n  2. {warmup.format(role='actor')}\n"
        f"  3. {split.format(role='critic')}\n  4. {warmup.format(role='critic')}\n")
    assert main(argv) == 2  # the default token budgets pack: 2 rows per rank and mini-batch are enough
    assert capsys.readouterr().err == (f"rlhf config: error: 2 problems in the config:\n  1. "
                                       f"{warmup.format(role='actor')}\n  2. {warmup.format(role='critic')}\n")
    assert not (paths["root"] / "runs").exists()
    fixed = ["actor.mini_batches=1", "critic.mini_batches=1", "critic.micro_batch_size=4", "trainer.total_steps=20"]
    assert main(argv + fixed) == 0
    assert capsys.readouterr().out == "config OK for 2 ranks: every check rlhf train runs before it starts passed\n"


def test_check_refuses_prompt_and_response_past_the_model_positions(newcomer_inputs, capsys):
    """A 128-position model, 44-token prompts and 100 new tokens: refused with the lengths and the keys."""
    paths = newcomer_inputs
    argv = ["config", "--check", f"model.path={paths['model']}", f"data.train_files={paths['train']}",
            "data.prompts_per_step=2", "sampling.max_new_tokens=100", "rollout.native.max_seq_len=256"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "rlhf config: error: the longest prompt in data.train_files (44 tokens) + sampling.max_new_tokens=100 = 144 "
        f"positions, but model.path={paths['model']!r} has max_position_embeddings=128; lower "
        "sampling.max_new_tokens, or data.max_prompt_length with data.truncation=filter (or left), to fit 128\n")
    assert main(argv + ["data.max_prompt_length=28", "data.truncation=left"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "note: data.train_files: 6 truncated (left end cut) of 6 prompts longer than data.max_prompt_length=28 "
        "tokens (data.truncation=left)",
        "config OK for 1 rank: every check rlhf train runs before it starts passed"]


def test_check_names_the_key_of_a_missing_data_file_and_a_missing_vllm(newcomer_inputs, capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    paths = newcomer_inputs
    assert main(["config", "--check", f"model.path={paths['model']}", "data.train_files=/no/such.jsonl",
                 "rollout.engine=vllm", "sampling.max_new_tokens=8"]) == 2
    from rlhf.rollout.vllm_engine import INSTALL_HINT

    assert capsys.readouterr().err == (
        f"rlhf config: error: 2 problems in the config:\n  1. {INSTALL_HINT}\n"
        "  2. data.train_files: '/no/such.jsonl' is not a file; point data.train_files at a .jsonl or .parquet "
        "prompt file (e.g. one made by `rlhf data make`)\n")
