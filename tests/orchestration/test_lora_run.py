"""GRPO with a LoRA actor end to end on 2 gloo ranks (the ref as the actor's base; the native engine on the actor's
weights, and fed merged weights through the resharding path), exact resume from an adapter-only checkpoint, and
its PEFT / merged exports; adapter-only sync (lora.sync=adapter) against merged sync. One launched world."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8", "actor.optim.lr=0.05", "algo.kl.coef=0.01",
        "trainer.val_before_train=false", "data.val_files=[]", "run.name=r"]


def _runs(paths, root):
    length_reward = Path(root) / "length_reward.py"  # a dense signal, so the update really moves the adapters
    length_reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                             "    return float(len(solution) % 2)\n")
    common = LORA + ["reward.by_source={}", f"reward.function={length_reward}:score", "checkpoint.every=1"]
    # the colocated native engine on the actor's own weights (merging the adapters into its packed weights)
    full = run_trainer(paths, f"{root}/full", common + ["trainer.total_steps=2"])
    imported = _continue_from_export(paths, root, common)
    run_trainer(paths, f"{root}/split", common + ["trainer.total_steps=1"])
    resumed = run_trainer(paths, f"{root}/split", common + ["trainer.total_steps=2"])
    # actor tp2 -> rollout tp1: the merged weights through the resharding path, checked bitwise on every sync
    resharded = run_trainer(paths, f"{root}/reshard", common + ["trainer.total_steps=2", "mesh.actor.tp=2",
                                                                "mesh.rollout.tp=1", "comm.verify=true"])
    # the same, with only the adapters travelling (the engine keeps its base and merges on its side)
    adapter = run_trainer(paths, f"{root}/adapter", common + ["trainer.total_steps=2", "mesh.actor.tp=2",
                                                             "mesh.rollout.tp=1", "comm.verify=true",
                                                             "lora.sync=adapter"])
    # the same with the actor's params, grads and Adam state parked on the host during each rollout
    offloaded = run_trainer(paths, f"{root}/offload", common + ["trainer.total_steps=2", "mesh.actor.tp=2",
                                                               "mesh.rollout.tp=1", "comm.verify=true",
                                                               "lora.sync=adapter", "actor.optim.offload=true"])
    # split placement (trainer on rank 0, engine on rank 1): the adapter slices cross ranks, both ways compared
    split = common + ["trainer.total_steps=2", "mesh.placement=split", "mesh.actor={ranks: [0, 1]}",
                      "mesh.rollout={ranks: [1, 2]}", "mesh.ref={ranks: [0, 1]}", "comm.verify=true"]
    split_runs = tuple(run_trainer(paths, f"{root}/split_{sync}", split + [f"lora.sync={sync}"])
                       for sync in ("merged", "adapter"))
    # PPO with a LoRA critic too (its value head fully trained), resumed exactly
    ppo = common + ["algo.advantage.kind=gae", "algo.advantage.lam=0.95", "lora.critic=true",
                    "critic.optim.lr=0.05"]
    ppo_full = run_trainer(paths, f"{root}/ppo", ppo + ["trainer.total_steps=2"])
    run_trainer(paths, f"{root}/ppo_split", ppo + ["trainer.total_steps=1"])
    ppo_resumed = run_trainer(paths, f"{root}/ppo_split", ppo + ["trainer.total_steps=2"])
    # a bf16 base with fp32 adapters (lora.dtype=fp32), resumed exactly from its adapter-only checkpoint
    bf16 = common + ["model.dtype=bfloat16"]
    bf16_full = run_trainer(paths, f"{root}/bf16", bf16 + ["trainer.total_steps=2"])
    run_trainer(paths, f"{root}/bf16_split", bf16 + ["trainer.total_steps=1"])
    bf16_resumed = run_trainer(paths, f"{root}/bf16_split", bf16 + ["trainer.total_steps=2"])
    return (full, resumed, resharded, adapter, (ppo_full, ppo_resumed), (bf16_full, bf16_resumed), split_runs,
            _resume_on_another_base(paths, root, common), imported, offloaded)


def _continue_from_export(paths, root, common):
    """The full run's adapters through `rlhf export`, imported at tp2 (their logits, to compare with PEFT's on the
    exported folder) and continued by a run that starts from them (`lora.adapter_path`)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from rlhf.models.config import LoraConfig
    from rlhf.models.forward import forward_backward
    from rlhf.models.lora import apply_lora
    from rlhf.models.lora_peft import load_peft_folder
    from rlhf.orchestration.export import export_lora_checkpoint
    from rlhf.parallel.groups import GroupCache
    from tests.models import world

    folder, lora = f"{root}/exported", LoraConfig(enabled=True, rank=4, alpha=8)
    if dist.get_rank() == 0:  # what `rlhf export` runs (the CLI starts a world of its own)
        export_lora_checkpoint(f"{root}/full/r/checkpoints/step_2", folder, lora, paths["model"])
    dist.barrier()
    model, groups = world.layout_model(paths["model"], 2, 1, GroupCache())
    apply_lora(model, lora)
    load_peft_folder(model, folder)
    tokens = torch.randint(0, AutoConfig.from_pretrained(paths["model"]).vocab_size, (2, 9),
                           generator=torch.Generator().manual_seed(0))
    loss_fn = world.rl_loss(groups, AutoConfig.from_pretrained(paths["model"]).vocab_size)
    reports = forward_backward(model, [world.MicroBatch(tokens)], loss_fn, groups, forward_only=True)
    continued = run_trainer(paths, f"{root}/continued", common + ["trainer.total_steps=1",
                                                                  f"lora.adapter_path={folder}"])
    return folder, tokens, reports[0]["logits"] if world.is_reporter(groups) else None, continued


def _resume_on_another_base(paths, root, common) -> str:
    """The error of resuming the split run's adapters on a base whose bytes differ (one weight moved)."""
    import shutil

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from rlhf.errors import CheckpointError

    other = Path(root) / "other_base"
    if dist.get_rank() == 0:
        shutil.copytree(paths["model"], other)
        weights = load_file(other / "model.safetensors")
        weights["model.norm.weight"] = weights["model.norm.weight"] + 1.0
        save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    dist.barrier()
    try:
        run_trainer(paths, f"{root}/split", common + ["trainer.total_steps=3", f"model.path={other}"])
    except CheckpointError as error:
        return str(error)
    return "resumed"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_run")
    paths = make_tiny_setup(root / "tiny")
    return (root, paths, *run_distributed(_runs, 2, paths, str(root), timeout_s=1200)[0])


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/throughput", "memory/", "sync/"))}


def test_grpo_with_lora_trains_and_resumes_exactly(lora_run):
    _, _, full, resumed, resharded = lora_run[:5]
    for run in (full, resharded):
        assert [row["step"] for row in run] == [1, 2]
        for row in run:
            assert row["rollout/logprob_diff_max"] < 1e-4, "the engine generates with base + adapters"
        assert run[0]["actor/kl_loss"] == 0.0, "B starts at zero: the actor is its base (the ref) before any update"
        assert run[-1]["actor/kl_loss"] > 0.0, "the ref stays the base while the adapters move"
    assert [row["step"] for row in resumed] == [2]
    assert [_comparable(r) for r in full[1:]] == [_comparable(r) for r in resumed]


def test_adapter_sync_runs_as_merged_sync_and_moves_the_adapter_slices_only(lora_run):
    from transformers import AutoConfig

    from rlhf.models.config import LoraConfig
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.reshard.lora_sync import adapter_specs
    from rlhf.reshard.planner import plan

    paths, merged, adapter, (split_merged, split_adapter) = lora_run[1], lora_run[4], lora_run[5], lora_run[8]
    # comm.verify checked the engine's merged view against the trainer's merged weights bitwise on every sync,
    # so the rollouts, their logprobs and every update are the merged-sync run's
    assert [_comparable(r) for r in adapter] == [_comparable(r) for r in merged]
    assert [_comparable(r) for r in split_adapter] == [_comparable(r) for r in split_merged]
    config = AutoConfig.from_pretrained(paths["model"])
    lora = LoraConfig(enabled=True, rank=4, alpha=8)
    adapter_numel = sum(spec.full_shape[0] * spec.full_shape[1]
                        for spec in adapter_specs(config, lora, ParallelLayout(tp=1)))
    for run, src, dst in ((adapter, ParallelLayout(tp=2), ParallelLayout(tp=1, dp=2)),
                          (split_adapter, ParallelLayout(tp=1), ParallelLayout(tp=1, first_rank=1))):
        adapter_plan = plan(src, dst, adapter_specs(config, lora, src), adapter_specs(config, lora, dst),
                            vocab_size=config.vocab_size)
        adapter_bytes = 4 * sum(adapter_plan.received_numel(rank) for rank in dst.ranks)
        assert adapter_bytes > 0 and all(row["sync/bytes_received"] == adapter_bytes for row in run)
    assert split_adapter[0]["sync/bytes_received"] == 4 * adapter_numel, "split: the whole adapter crosses"


def test_offloading_the_lora_actor_between_phases_changes_nothing(lora_run):
    adapter, offloaded = lora_run[5], lora_run[-1]
    assert [_comparable(r) for r in offloaded] == [_comparable(r) for r in adapter]


def test_ppo_with_a_lora_critic_trains_its_adapters_and_head_and_resumes_exactly(lora_run):
    from safetensors import safe_open

    root, (full, resumed) = lora_run[0], lora_run[6]
    assert [row["step"] for row in full] == [1, 2] and [row["step"] for row in resumed] == [2]
    assert [_comparable(r) for r in full[1:]] == [_comparable(r) for r in resumed]
    assert all(row["critic/grad_norm"] > 0 for row in full)
    names = {}
    for path in sorted((root / "ppo/r/checkpoints/step_2").rglob("*.safetensors")):
        if not path.name.startswith("rank"):
            with safe_open(str(path), framework="pt") as handle:
                names.setdefault(path.name.split("_")[0], set()).update(handle.keys())
    critic = names["critic"]
    assert "score.weight" in critic and len(critic - {"score.weight"}) == 2 * 2 * 7, sorted(critic)[:5]
    assert all(".lora_A." in n or ".lora_B." in n for n in critic - {"score.weight"})


def test_a_bf16_base_trains_fp32_adapters_and_resumes_exactly(lora_run):
    import torch
    from safetensors import safe_open

    root, (full, resumed) = lora_run[0], lora_run[7]
    assert [row["step"] for row in full] == [1, 2] and [row["step"] for row in resumed] == [2]
    assert [_comparable(r) for r in full[1:]] == [_comparable(r) for r in resumed]
    assert full[-1]["actor/kl_loss"] > 0.0
    with safe_open(str(root / "bf16/r/checkpoints/step_2/actor_model_r0.safetensors"), framework="pt") as handle:
        assert {handle.get_tensor(name).dtype for name in handle.keys()} == {torch.float32}


def test_an_exported_adapter_imports_as_peft_loads_it_and_a_run_continues_from_it(lora_run):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    paths, (folder, tokens, logits, continued) = lora_run[1], lora_run[-2]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(paths["model"]), folder)
    with torch.no_grad():
        assert (peft_model(tokens).logits - logits).abs().max() <= 1e-5
    assert [row["step"] for row in continued] == [1]
    assert continued[0]["actor/kl_loss"] > 0.0, "it starts from the trained adapters, not from the base (B = 0)"


def test_resuming_adapters_on_another_base_is_a_one_line_error(lora_run):
    root, paths, error = lora_run[0], lora_run[1], lora_run[-3]
    import re

    assert re.fullmatch(re.escape(f"the actor checkpoint's LoRA adapters were trained on {paths['model']} (sha256 ")
                        + "[0-9a-f]{12}" + re.escape(f"), not on this run's model.path {root}/other_base (sha256 ")
                        + "[0-9a-f]{12}" + re.escape("); resume with the base model it was trained on"), error), error
    assert "\n" not in error


def test_the_checkpoint_holds_the_adapters_and_their_adam_state_only(lora_run):
    from safetensors import safe_open

    root = lora_run[0]
    step = root / "full/r/checkpoints/step_2"
    files = sorted(step.rglob("*.safetensors"))
    names = set()
    for path in files:
        if path.name.startswith("rank"):
            continue
        with safe_open(str(path), framework="pt") as handle:
            names |= set(handle.keys())
    assert names and all(".lora_A." in name or ".lora_B." in name for name in names), sorted(names)[:5]
    assert len({n for n in names}) == 2 * 2 * 7, "A and B of q/k/v/o/gate/up/down in 2 layers"


def test_export_writes_a_peft_folder_peft_loads_and_a_merged_model_equal_to_peft_merge(lora_run, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlhf.cli.main import main

    root, paths = lora_run[:2]
    run_dir = root / "full/r"
    assert main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "peft")]) == 0
    assert main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "merged"), "--lora", "merged"]) == 0
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(paths["model"]), tmp_path / "peft")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    tokens = torch.randint(0, merged.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_logits, merged_logits = peft_model(tokens).logits, merged(tokens).logits
        base_logits = AutoModelForCausalLM.from_pretrained(paths["model"])(tokens).logits
    assert (peft_logits - merged_logits).abs().max() <= 1e-5
    assert (peft_logits - base_logits).abs().max() > 1e-3, "the trained adapters moved the model"
    reference = peft_model.merge_and_unload().state_dict()
    exported = {k: v for f in sorted((tmp_path / "merged").glob("*.safetensors")) for k, v in load_file(f).items()}
    for name, tensor in exported.items():
        assert torch.equal(tensor, reference[name]), name
