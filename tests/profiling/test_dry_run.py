"""`rlhf plan --world N` at 1024 and 4096 simulated ranks (fake process groups, one process each), checked
against the global reshard plan and the model's own parameter count; micro-batch counts with packing; `--fit`
on Qwen3-8B's shapes at 32k-token responses; one-line errors for bad flags."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from rlhf.parallel.layout import ParallelLayout
from rlhf.models.param_specs import param_specs
from rlhf.models.spec import ModelSpec
from rlhf.profiling.activations import MicroBatchShape, activation_bytes
from rlhf.profiling.dry_run import MemoryPlan, role_estimate, stage_params
from rlhf.reshard.planner import plan_for_model
from tests.models.tiny import llama_config

ROOT = Path(__file__).resolve().parents[2]
LAYOUT_ARGS = ["mesh.actor.tp=8", "mesh.actor.pp=4", "mesh.rollout.tp=4", "actor.micro_batch_size=4",
               "sampling.n=8", "actor.optim.use_distributed_optimizer=true", "rollout.native.max_batch_size=16",
               "rollout.native.max_seq_len=64"]


def _config():
    return llama_config(num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama8")
    _config().save_pretrained(path)
    return str(path)


def _plan(model_dir: str, tmp_path: Path, world: int, rank: int) -> dict:
    out = tmp_path / f"plan_{world}.json"
    args = [sys.executable, "-m", "rlhf", "plan", "--world", str(world), "--as-rank", str(rank), "--json", str(out),
            f"model.path={model_dir}", f"data.prompts_per_step={world}", *LAYOUT_ARGS]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "weight sync on this rank: receives" in proc.stdout
    assert "this rank's peak: " in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.parametrize("world,rank", [(1024, 1000), (4096, 7)])
def test_plan_at_scale_matches_the_global_plan(model_dir, tmp_path, world, rank):
    report = _plan(model_dir, tmp_path, world, rank)
    actor, rollout = ParallelLayout(tp=8, pp=4, dp=world // 32), ParallelLayout(tp=4, dp=world // 4)
    assert report["layouts"] == {"actor": actor.describe(), "rollout": rollout.describe()}
    assert report["groups_created"] > 0
    whole = plan_for_model(_config(), actor, rollout)
    sync = report["weight_sync"]
    assert sync["received_bytes"] == whole.received_numel(rank) * 4 == sync["min_received_bytes"]
    assert sync["sent_bytes"] == whole.sent_numel(rank) * 4
    roles = {r["role"]: r for r in report["roles"]}
    coords = actor.coords(rank)
    assert (roles["actor"]["tp_rank"], roles["actor"]["dp_rank"], roles["actor"]["pp_rank"],
            roles["actor"]["cp_rank"]) == tuple(coords)
    params = stage_params(_config(), actor, coords.pp_rank, value_head=False)
    assert roles["actor"]["params"] == params
    assert roles["actor"]["optimizer_bytes"] == math.ceil(params * 8 / actor.dp)  # fp32 Adam over dp
    # the rollout engine has its own tp4 copy (another layout than the actor's): fp32 weights + its KV cache
    assert roles["rollout"]["weight_bytes"] == stage_params(_config(), rollout, 0, value_head=False) * 4
    kv = 2 * 8 * 16 * (8 // 4) * 64 * 8 * 4  # k+v, layers, slots, kv heads per tp rank, seq, head_dim, fp32
    assert roles["rollout"]["kv_cache_bytes"] == kv
    # activations: the actor's update micro-batch (4 rows of 512 + 64 tokens, packed: the auto budget is
    # micro_batch_size x the longest row) on its pipeline stage; the peak is every role's state plus the largest
    # activation peak
    shape = MicroBatchShape(tokens=4 * 576, padded_rows=0, tp=8, pp=4, pp_rank=coords.pp_rank,
                            micro_batches=world * 8 // actor.dp // 4,
                            dtype_bytes=4, head_rows=4 * 64)  # 1F1B: pp - stage in flight
    assert roles["actor"]["activation_bytes"] == activation_bytes(ModelSpec.from_hf(_config()), shape).total_bytes
    memory = report["memory"]
    assert memory["peak_bytes"] == report["rank_total_bytes"] + roles["actor"]["activation_bytes"]


def test_stage_params_add_up_to_the_hf_model():
    config = _config()
    hf_params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert stage_params(config, ParallelLayout(), 0, value_head=False) == hf_params
    layout = ParallelLayout(tp=2, pp=2)
    replicated = sum(math.prod(s.full_shape) for s in param_specs(config, layout) if s.partition_dim is None)
    padded_vocab_rows = 2 * (layout.tp * math.ceil(config.vocab_size / layout.tp) - config.vocab_size)
    total = sum(stage_params(config, layout, pp, value_head=False) for pp in range(2)) * layout.tp
    assert total - (layout.tp - 1) * replicated - padded_vocab_rows * config.hidden_size == hf_params


def test_bad_rank_and_bad_layout_are_one_line_errors(model_dir, capsys):
    from rlhf.cli.main import main

    assert main(["plan", "--world", "4", "--as-rank", "4", f"model.path={model_dir}"]) == 2
    assert capsys.readouterr().err == "rlhf plan: error: --world=4 must be >= 1 and --as-rank=4 in [0, 4)\n"
    assert main(["plan", "--world", "6", f"model.path={model_dir}", "mesh.actor.tp=4"]) == 2
    assert capsys.readouterr().err.startswith("rlhf plan: error: ")


def test_plan_at_scale_covers_an_moe_layout(tmp_path):
    """1024 ranks, a Qwen3-MoE actor at pp2 x ep4 (experts split inside dp) and an ep1 rollout: this rank's
    planned receipt = the global plan's = the theoretical minimum."""
    from tests.models.tiny import qwen3_moe_config

    config = qwen3_moe_config(num_experts=8)
    config.save_pretrained(tmp_path / "moe")
    world, rank = 1024, 1000
    out = tmp_path / "plan.json"
    args = [sys.executable, "-m", "rlhf", "plan", "--world", str(world), "--as-rank", str(rank), "--json", str(out),
            f"model.path={tmp_path / 'moe'}", f"data.prompts_per_step={world}", "mesh.actor.pp=2", "mesh.actor.ep=4",
            "sampling.n=8", "actor.micro_batch_size=4", "rollout.native.max_batch_size=16",
            "rollout.native.max_seq_len=64"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    actor, rollout = ParallelLayout(pp=2, dp=world // 2, ep=4), ParallelLayout(dp=world)
    assert report["layouts"] == {"actor": actor.describe(), "rollout": rollout.describe()}
    sync = report["weight_sync"]
    whole = plan_for_model(config, actor, rollout)
    assert sync["received_bytes"] == whole.received_numel(rank) * 4 == sync["min_received_bytes"] > 0
    assert sync["sent_bytes"] == whole.sent_numel(rank) * 4


def _cfg(model_dir: str, *overrides: str):
    from rlhf.config import load_config
    from rlhf.orchestration.schema import RlhfConfig

    return load_config(RlhfConfig, None, [f"model.path={model_dir}", "data.prompts_per_step=8", "sampling.n=4",
                                          "data.max_prompt_length=16", "sampling.max_new_tokens=48",
                                          "actor.epochs=2", "actor.mini_batches=2", "actor.micro_batch_size=4",
                                          *overrides])


def test_packed_micro_batches_come_from_pack_plan(model_dir):
    """32 rollouts of 16 + 48 tokens, 2 mini-batches over dp=2: 8 rows per rank and mini-batch. Packed into 200
    tokens that is 3 rows (192 tokens) per bin, ceil(8 / 3) = 3 bins; by rows of 4, 2 micro-batches."""
    from rlhf.errors import ConfigError

    layout = ParallelLayout(dp=2)
    packed = role_estimate("actor", layout, _config(), _cfg(model_dir, "actor.max_tokens_per_microbatch=200"), 0,
                           False)
    rows = role_estimate("actor", layout, _config(), _cfg(model_dir, "actor.max_tokens_per_microbatch=0"), 0, False)
    assert (packed.micro_batches_per_step, packed.micro_batch_tokens) == (2 * 2 * 3, 3 * 64)
    assert (rows.micro_batches_per_step, rows.micro_batch_tokens) == (2 * 2 * 2, 4 * 64)
    assert packed.activation_pass == rows.activation_pass == "update"
    # planning 80-token responses: rows of 96 tokens, 2 per 200-token bin, 4 bins per mini-batch
    longer = role_estimate("actor", layout, _config(), _cfg(model_dir, "actor.max_tokens_per_microbatch=200"), 0,
                           False, MemoryPlan(response_length=80))
    assert (longer.micro_batches_per_step, longer.micro_batch_tokens) == (2 * 2 * 4, 2 * 96)
    with pytest.raises(ConfigError, match=r"actor.max_tokens_per_microbatch=200 is smaller than the longest row "
                                          r"\(256 tokens"):
        role_estimate("actor", layout, _config(), _cfg(model_dir, "actor.max_tokens_per_microbatch=200"), 0, False,
                      MemoryPlan(response_length=240))


QWEN3_8B = ["--config", "configs/plan_qwen3_8b_32k.yaml", "--world", "8", "--memory-gib", "80", "--seq-len", "32768"]


def test_fit_lists_the_qwen3_8b_32k_layouts(tmp_path, capsys, monkeypatch):
    from rlhf.cli.main import main

    monkeypatch.chdir(ROOT)
    out = tmp_path / "fit.json"
    assert main(["plan", *QWEN3_8B, "--fit", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("rlhf plan --fit: 8 ranks, actor on each layout (the rollout engine not counted), "
                        "80 GiB per device")
    assert lines[1].startswith("activations: flash/TE attention (no s^2 term")
    assert lines[3].split() == ["4", "2", "1", "1", "33,792", "22.89", "43.51", "66.40", "yes", "actor", "update"]
    assert lines[4].split() == ["2", "4", "1", "1", "33,792", "34.33", "33.81", "68.14", "yes", "actor", "update"]
    assert lines[-1].startswith("2 of 19 layouts fit; 1 skipped")
    report = json.loads(out.read_text())
    assert [(r["tp"], r["cp"], r["pp"], r["dp"]) for r in report["layouts"] if r["fits"]] == [(4, 2, 1, 1),
                                                                                             (2, 4, 1, 1)]
    no_cp = {(r["tp"], r["pp"]): r for r in report["layouts"] if r["cp"] == 1}
    assert not any(r["fits"] for r in no_cp.values())  # without context parallelism 32k rows do not fit
    # full recompute: tp8 alone fits (its activations drop to the layer inputs plus one layer)
    assert main(["plan", *QWEN3_8B, "--fit", "--recompute", "full", "--json", str(out)]) == 0
    capsys.readouterr()
    recomputed = {(r["tp"], r["cp"], r["pp"]): r for r in json.loads(out.read_text())["layouts"]}
    assert recomputed[(8, 1, 1)]["fits"] and recomputed[(8, 1, 1)]["activation_bytes"] < \
        no_cp[(8, 1)]["activation_bytes"] / 4
    assert main(["plan", *QWEN3_8B, "--fit", "--memory-gib", "16"]) == 0  # the last --memory-gib counts
    assert capsys.readouterr().out.splitlines()[-1].startswith("0 of 19 layouts fit; 1 skipped")
    # 64k responses do not fit the 33,792-token budget on any layout: one line, before any layout is tried
    assert main(["plan", *QWEN3_8B, "--fit", "--seq-len", "65536"]) == 2
    assert capsys.readouterr().err == ("rlhf plan: error: actor.max_tokens_per_microbatch=33792 is smaller than the "
                                       "longest row (66560 tokens: prompt + response); raise "
                                       "actor.max_tokens_per_microbatch to at least 66560\n")


@pytest.mark.parametrize("flags,message", [
    (["--memory-gib", "0"], "--memory-gib=0 must be > 0 (GiB per device)"),
    (["--memory-gib", "-8"], "--memory-gib=-8 must be > 0 (GiB per device)"),
    (["--seq-len", "0"], "--seq-len=0 must be >= 1 (response tokens to plan for)"),
    (["--fit"], "--fit needs --memory-gib (the memory per device the layouts must fit)"),
    (["--recompute", "some"], "--recompute=some is not one of none, full, selective"),
])
def test_bad_plan_flags_are_one_line_errors(model_dir, capsys, flags, message):
    from rlhf.cli.main import main

    assert main(["plan", "--world", "4", f"model.path={model_dir}", *flags]) == 2
    assert capsys.readouterr().err == f"rlhf plan: error: {message}\n"
