"""The start banner and end summary: each role's layout and parameter count (= the HF model's), data sizes,
the run folder, the checkpoint and the export command that comes next."""

from __future__ import annotations

from pathlib import Path

from rlhf.config import load_config
from rlhf.orchestration.schema import RlhfConfig
from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.models.init import InitModelConfig, init_hf_model
from rlhf.orchestration.console import end_summary, parameter_count, start_banner


def _model(tmp_path: Path) -> str:
    dims = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                max_position_embeddings=64)
    return str(init_hf_model(InitModelConfig(**dims), build_char_tokenizer(), tmp_path / "model"))


def test_parameter_count_is_the_hf_models(tmp_path):
    from transformers import AutoModelForCausalLM

    path = _model(tmp_path)
    hf_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    assert parameter_count(path) == hf_params == 19744
    assert parameter_count(path, value_head=True) == hf_params - 18 * 32 + 32  # LM head [18, 32] -> value head [1, 32]


def test_banner_and_summary(tmp_path):
    path = _model(tmp_path)
    cfg = load_config(RlhfConfig, None, [f"model.path={path}", "algo.advantage.kind=gae", "trainer.total_steps=5"])
    rows = [{"role": "actor", "tp": 2, "pp": 1, "dp": 1, "ranks": "0..1"},
            {"role": "critic", "tp": 1, "pp": 1, "dp": 2, "ranks": "0..1"},
            {"role": "rollout", "tp": 1, "pp": 1, "dp": 2, "ranks": "0..1"}]
    run = tmp_path / "runs" / "r"
    assert start_banner(cfg, world_size=2, backend="gloo", mesh_rows=rows, num_train=64, num_val=16, run_path=run,
                        start_step=2) == [
        f"rlhf train: 2 ranks (gloo), colocated placement, run folder {run}",
        f"  actor    tp2 pp1 dp1  ranks 0..1  0.020M params  {path}",
        f"  critic   tp1 pp1 dp2  ranks 0..1  0.019M params  {path}",
        "  rollout  tp1 pp1 dp2  ranks 0..1  native engine",
        "data: 64 training prompts, 16 validation prompts; a step samples 8 prompts x 4 = 32 responses",
        "steps 3..5 (resuming after step 2)"]
    summary = end_summary(cfg, run_path=run, last_step=5, elapsed_s=12.34,
                          checkpoint=run / "checkpoints/step_5")
    assert summary == [f"done: step 5 of 5 in 12.3 s; metrics in {run}/metrics.jsonl, logs in {run}/rank<k>.log",
                       f"checkpoint: {run}/checkpoints/step_5",
                       f"next, the actor as an HF folder (one process, whatever the world size): rlhf export "
                       f"--run-dir {run} --out {run}/hf"]
    assert end_summary(cfg, run_path=run, last_step=5, elapsed_s=1, checkpoint=None)[1] == (
        "no checkpoint was saved (checkpoint.every=0 and checkpoint.save_at_end=false)")
