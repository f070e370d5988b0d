"""`rlhf sft` (rlhf.orchestration.sft): the first step's loss is transformers' answer NLL of the same batch, the same
losses with the fused LM head and with full logits at TP2, the loss falls, validation runs, and the exported folder
loads in transformers with the trained weights; a stalled rank ends the run with stacks, and the relaunch resumes
to the uninterrupted run's metrics; bad input is one line before anything is written."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=32, num_val=4)


def _sft_runs(paths, root):
    """Both runs' last validation and folder, and this rank's python and numpy RNG states in the last checkpoint."""
    import torch.distributed as dist

    from rlhf.checkpoint.state_file import decode_state
    from rlhf.run_dir import close_run, setup_run
    from rlhf.orchestration.sft import run_sft

    def sft(fused: bool, export: str) -> tuple[dict, Path]:
        cfg = trainer_config(paths, root, ["mesh.actor.tp=2", "sft.steps=4", "sft.batch_size=8",
                                           "actor.micro_batch_size=4", f"model.fused_head={fused}",
                                           f"run.name=sft_{fused}", f"sft.out_dir={root}/{export}"])
        run_dir = setup_run(cfg.run, cfg, prefix="sft")
        try:
            return run_sft(cfg, cfg.sft, run_dir), run_dir.path
        finally:
            close_run()

    out = {fused: sft(fused, f"export_{fused}") for fused in (True, False)}
    relaunched, run_path = sft(False, "export_resumed")  # finished: says so, exports what it resumed
    assert relaunched == {}
    if dist.get_rank() == 0:
        assert ("already finished: its checkpoint is at step 4 and sft.steps=4; raise sft.steps to train on"
                in (run_path / "rank0.log").read_text())
    state = decode_state((out[True][1] / f"checkpoints/step_4/rank{dist.get_rank()}.safetensors").read_bytes(),
                         "rank file")
    return out, state["rng"]["python"], state["rng"]["numpy"]


def _hf_first_step_loss(paths, root) -> float:
    """transformers' token-mean NLL over the answer tokens (+ EOS) of the batch `rlhf sft` draws first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.data.loader import load_prompts
    from rlhf.data.sampler import PromptSampler
    from rlhf.orchestration.sft import sft_batch

    cfg = trainer_config(paths, root, ["sft.batch_size=8"])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train = load_prompts(cfg.data.train_files, tokenizer, cfg.data)
    sampler = PromptSampler(num_samples=len(train.records), global_batch_size=8, dp_rank=0, dp_size=1,
                            batch_key="sft.batch_size", seed=cfg.data.seed)
    batch = sft_batch(train, sampler.next_indices(), tokenizer, pad)
    positions = torch.arange(batch.tokens_bs.shape[1])[None, :] - batch.prompt_lengths_b[:, None]
    answer = (positions >= 0) & (positions < batch.response_lengths_b[:, None])
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(batch.tokens_bs).logits.float(), dim=-1)[:, :-1]
    picked = logprobs.gather(-1, batch.tokens_bs[:, 1:, None]).squeeze(-1)
    weights = answer[:, 1:].float()
    return float(-(picked * weights).sum() / weights.sum())


def test_sft_fused_head_matches_full_logits_at_tp2(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    ranks = run_distributed(_sft_runs, 2, tiny, str(tmp_path), timeout_s=300)
    runs = ranks[0][0]
    # no process seeded them before the trainer did (run_distributed does not): every rank's are the run seed's
    assert ranks[0][1] == ranks[1][1] and len(ranks[0][1][1]) == 625  # python's (a library may draw at import)
    seeded = np.random.RandomState(trainer_config(tiny, str(tmp_path)).dist.seed).get_state()
    for rank in ranks:
        assert rank[2][0] == seeded[0] and np.array_equal(rank[2][1], seeded[1]) and rank[2][2:] == seeded[2:]
    losses = {}
    for fused, (val, path) in runs.items():
        rows = [json.loads(line) for line in (Path(path) / "metrics.jsonl").read_text().splitlines()]
        losses[fused] = [row["sft/loss"] for row in rows if "sft/loss" in row]
        assert "val/score/mean@1" in val
    assert len(losses[True]) == 4
    assert losses[True][0] == pytest.approx(_hf_first_step_loss(tiny, str(tmp_path)), abs=1e-5)
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)
    assert losses[True][-1] < losses[True][0]
    exported = [AutoModelForCausalLM.from_pretrained(tmp_path / f"export_{fused}") for fused in (True, False)]
    initial = AutoModelForCausalLM.from_pretrained(tiny["model"])
    for name, param in exported[0].named_parameters():
        # Adam (lr 1e-3) turns fp32-rounding gradient differences into ~1e-5 steps; a wrong path moves ~1e-3
        torch.testing.assert_close(param, dict(exported[1].named_parameters())[name], atol=1e-4, rtol=0)
    assert any(not torch.equal(p, q) for p, q in zip(exported[0].parameters(), initial.parameters()))
    resumed = AutoModelForCausalLM.from_pretrained(tmp_path / "export_resumed")
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), exported[1].parameters()))


NOISY_FN = '''
import os
import random
import time

import numpy as np

CALLS = [0]


def noisy(data_source, solution_str, ground_truth, extra_info):
    """A validation score drawn from python's and numpy's RNGs; rank 1 stalls on its SFT_STALL_AT-th call."""
    CALLS[0] += 1
    if os.environ["RANK"] == "1" and str(CALLS[0]) == os.environ.get("SFT_STALL_AT"):
        time.sleep(3600)
    return random.random() + float(np.random.random())
'''


def _launch(config: Path, extra_env: dict[str, str]) -> list:
    """Both ranks of `rlhf sft --config config`, started directly (no torchrun)."""
    import os
    import subprocess

    from rlhf.testing.distributed import free_port

    port, root = free_port(), Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra_env}
    return [subprocess.Popen([sys.executable, "-m", "rlhf", "sft", "--config", str(config)],
                             env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for rank in range(2)]


def _exit_codes(procs: list, timeout_s: float = 400) -> list[int]:
    import subprocess

    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)  # a guard against a hang only
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]


def _metrics(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock and process-memory keys."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/", "memory/"))} for row in rows]


@pytest.mark.slow  # three 2-rank launches and a watchdog deadline; the RL stall is in the default suite
def test_a_stalled_sft_rank_ends_the_run_with_stacks_and_auto_resume_gives_the_uninterrupted_metrics(tiny, tmp_path):
    """Rank 1 stalls in step 3's validation: the watchdog ends both ranks (exit 124, stacks in each log). The
    relaunch resumes step 2's checkpoint and its whole metrics.jsonl equals an uninterrupted run's bitwise, the
    validation scores drawn from python's and numpy's RNGs included (seeded at start, restored on resume)."""
    import re

    from rlhf.config.loader import save_config
    from rlhf.parallel.watchdog import EXIT_CODE

    (tmp_path / "noisy.py").write_text(NOISY_FN)
    configs = {}
    for name in ("killed", "whole"):
        configs[name] = tmp_path / f"{name}.yaml"
        save_config(trainer_config(tiny, str(tmp_path / "runs"), [
            "sft.steps=4", "sft.batch_size=8", "sft.val_every=1", "checkpoint.every=1", "comm.step_timeout_s=20",
            "reward.by_source={}", f"reward.function={tmp_path / 'noisy.py'}:noisy", f"run.name={name}"]),
            configs[name])
    killed = _launch(configs["killed"], {"SFT_STALL_AT": "5"})  # 2 validation prompts a rank: step 3's first
    whole = _launch(configs["whole"], {})
    assert _exit_codes(killed) == [EXIT_CODE, EXIT_CODE]
    assert _exit_codes(whole) == [0, 0]
    runs = tmp_path / "runs"
    logs = [(runs / "killed" / f"rank{rank}.log").read_text() for rank in range(2)]
    for rank, log in enumerate(logs):  # both ranks' deadlines run out together: either may fire first
        assert re.search(rf"\[rlhf watchdog\] rank {rank} pid {killed[rank].pid}: (aborting because rank "
                         rf"{1 - rank}: )?phase 'sft_step 3' exceeded its 20s deadline\n", log), log[-3000:]
        assert "most recent call first" in log
    assert "in noisy" in logs[1]
    assert [row["step"] for row in _metrics(runs / "killed")] == [1, 2]
    assert _exit_codes(_launch(configs["killed"], {})) == [0, 0]
    assert "(step 2)" in (runs / "killed" / "rank0.log").read_text().split("resumed from", 1)[1].splitlines()[0]
    resumed, uninterrupted = _metrics(runs / "killed"), _metrics(runs / "whole")
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]
    assert resumed == uninterrupted
    assert len({row["val/score/mean@1"] for row in resumed}) == 4  # the RNGs moved between validations


def test_sft_bad_input_is_one_line_before_anything_is_written(tiny, tmp_path):
    from rlhf.errors import ConfigError
    from rlhf.orchestration.sft import sft_preflight

    cfg = trainer_config(tiny, str(tmp_path / "runs"), ["sft.batch_size=6", "actor.micro_batch_size=2",
                                                        "actor.max_tokens_per_microbatch=0"])  # row counts
    with pytest.raises(ConfigError, match=r"^sft\.batch_size=6 must be a multiple of actor\.mini_batches=1 x dp=2 x "
                                          r"actor\.micro_batch_size=2$"):
        sft_preflight(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"^model\.path='/nope' is not a folder"):  # `rlhf train`'s checks too
        sft_preflight(trainer_config(tiny, str(tmp_path / "runs"), ["model.path=/nope"]), world_size=2)
    with pytest.raises(ConfigError, match=r"^the dataset has 32 prompts, fewer than sft\.batch_size=64; "):
        sft_preflight(trainer_config(tiny, str(tmp_path / "runs"), ["sft.batch_size=64"]), world_size=2)
    shared = trainer_config(tiny, str(tmp_path / "runs"), ["mesh.roles=[actor,ref,rollout]", "algo.kl.coef=0.01",
                                                           "sft.batch_size=8"])
    assert sft_preflight(shared, world_size=2) == []  # an RL config's roles and algo do not apply to SFT
    (tmp_path / "exported").mkdir()
    with pytest.raises(ConfigError, match=rf"^sft\.out_dir={tmp_path / 'exported'} already exists; the SFT policy is "
                                          r"exported to a new folder: choose another or remove it$"):
        sft_preflight(trainer_config(tiny, str(tmp_path / "runs"), [f"sft.out_dir={tmp_path / 'exported'}"]), 2)
    assert not (tmp_path / "runs").exists()


def test_sft_rows_longer_than_the_actor_budget_are_one_line(tiny, tmp_path):
    """SFT answers have no length limit: a packing actor's budget is checked against the data's longest row."""
    from transformers import AutoTokenizer

    from rlhf.data.loader import load_prompts
    from rlhf.errors import ConfigError
    from rlhf.orchestration.sft import answer_ids, sft_preflight

    cfg = trainer_config(tiny, str(tmp_path / "runs"), ["sft.batch_size=8"])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    train = load_prompts(cfg.data.train_files, tokenizer, cfg.data)
    longest = max(len(ids) + len(answer_ids(tokenizer, record)) for ids, record in zip(train.token_ids,
                                                                                       train.records))
    assert cfg.actor.max_tokens_per_microbatch == 4 * 21 >= longest  # auto: 4 rows of 16 + 5 tokens
    assert sft_preflight(cfg, world_size=2) == []
    # auto for 1-token responses: the longest prompt + 1, short of any prompt + answer + EOS
    prompt = max(map(len, train.token_ids))
    short = trainer_config(tiny, str(tmp_path / "runs"), ["sft.batch_size=8", "sampling.max_new_tokens=1",
                                                          f"data.max_prompt_length={prompt}",
                                                          "actor.micro_batch_size=1"])
    with pytest.raises(ConfigError, match=rf"^actor\.max_tokens_per_microbatch={prompt + 1} is smaller than the "
                                          rf"longest SFT row of data\.train_files, {longest} tokens \(prompt \+ answer "
                                          rf"\+ EOS; auto sizes the budget for data\.max_prompt_length \+ "
                                          rf"sampling\.max_new_tokens\); raise actor\.max_tokens_per_microbatch to at "
                                          rf"least {longest}, or set it to 0 \(row counts\)$"):
        sft_preflight(short, world_size=2)
