"""HF out from any world size: a checkpoint trained on 4 ranks (actor TP2 x DP2, distributed optimizer) is merged
into an HF folder by `rlhf export` and by `rlhf convert ckpt-to-hf` in ONE process, bitwise equal to the weights
the 4-rank model itself gathered at that step (`checkpoint.save_hf_every`), with tokenizer and generation config;
transformers loads it."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

SETTINGS = ["run.name=r", "mesh.actor.tp=2", "actor.optim.use_distributed_optimizer=true", "actor.optim.lr=0.05",
            "checkpoint.every=2", "checkpoint.save_hf_every=2", "trainer.total_steps=2",
            "trainer.val_before_train=false", "data.prompts_per_step=4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    paths = make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_val=4)
    (Path(paths["model"]) / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "do_sample": True}))
    return paths


def _train(paths, root):
    reward = Path(root) / "length_reward.py"  # a dense signal: every update moves the weights
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    return float(len(solution) % 2)\n")
    return run_trainer(paths, root, SETTINGS + ["reward.by_source={}", f"reward.function={reward}:score"])


def _export(run: str, model: str, out: str) -> list[int]:
    from rlhf.cli.main import main

    return [main(["export", "--run-dir", run, "--checkpoint", "step_2", "--out", f"{out}/exported"]),
            main(["convert", "ckpt-to-hf", "--ckpt", f"{run}/checkpoints/step_2", "--out", f"{out}/converted",
                  "--tokenizer-dir", model])]


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    loaded = {file: load_file(folder / file) for file in set(index.values())}
    return {name: loaded[file][name] for name, file in index.items()}


def test_export_from_a_4_rank_checkpoint_in_one_process_is_bitwise(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    history = run_distributed(_train, 4, tiny, str(tmp_path), timeout_s=900)[0]
    assert history[-1]["actor/grad_norm"] > 0
    run = tmp_path / "r"
    assert run_distributed(_export, 1, str(run), tiny["model"], str(tmp_path), timeout_s=300) == [[0, 0]]
    gathered = _tensors(run / "hf" / "step_2")  # the 4-rank model's own weights, gathered over TP at step 2
    for name in ("exported", "converted"):
        folder = tmp_path / name
        tensors = _tensors(folder)
        assert tensors.keys() == gathered.keys()
        assert all(tensors[key].dtype == gathered[key].dtype and tensors[key].equal(gathered[key]) for key in tensors)
        assert json.loads((folder / "generation_config.json").read_text())["do_sample"] is True
        assert (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    own = dict(model.named_parameters())
    assert all(own[key].detach().equal(value) for key, value in gathered.items())
    original = AutoModelForCausalLM.from_pretrained(tiny["model"])
    assert not all(param.equal(own[name]) for name, param in original.named_parameters())  # trained: weights moved
