"""The data path as DP ranks run it: shared file → PromptLoader slices → tokens → rewards, on 2 gloo ranks."""

import torch.distributed as dist

from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.data.config import DataConfig
from rlhf.data.loader import PromptLoader
from rlhf.data.make import MakeConfig, make_dataset
from rlhf.data.records import read_records
from rlhf.data.sampler import PromptSampler
from rlhf.rewards.registry import RewardConfig, RuleReward
from rlhf.testing.distributed import run_distributed

STEPS, PROMPTS_PER_STEP, SEED = 5, 8, 1234


def _rank_steps(path):
    config = DataConfig(train_files=[path], max_prompt_length=16, prompts_per_step=PROMPTS_PER_STEP, seed=SEED)
    loader = PromptLoader(config, build_char_tokenizer(), dp_rank=dist.get_rank(), dp_size=dist.get_world_size())
    reward = RuleReward(RewardConfig(by_source={"reasoning_gym/*": "reasoning_gym_exact"}))
    steps = []
    for _ in range(STEPS):
        step = loader.next_step()
        responses = [r.ground_truth if n % 2 == 0 else r.ground_truth + "1" for n, r in enumerate(step.records)]
        steps.append(([r.index for r in step.records], step.token_ids, reward.score(step.records, responses).tolist()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, steps)
    return gathered, loader.state_dict()


def test_ranks_take_disjoint_slices_of_the_global_batches(tmp_path):
    path = tmp_path / "train.parquet"
    make_dataset(MakeConfig(task="chain_sum", num_samples=30, seed=5, prompt_format="expression",
                            task_config={"max_terms": 3, "max_digits": 2}), path)
    (gathered, state0), (_, state1) = run_distributed(_rank_steps, 2, str(path), timeout_s=180)
    assert state0 == state1 and state0["epoch"] == 1  # 30 prompts = 3 batches of 8: step 5 is in epoch 1
    reference = PromptSampler(num_samples=30, global_batch_size=PROMPTS_PER_STEP, dp_rank=0, dp_size=1, seed=SEED)
    tokenizer = build_char_tokenizer()
    records = read_records(path)
    for step in range(STEPS):
        rank0, rank1 = gathered[0][step], gathered[1][step]
        assert rank0[0] + rank1[0] == reference.next_indices()
        assert not set(rank0[0]) & set(rank1[0])
        for indices, token_ids, rewards in (rank0, rank1):
            assert token_ids == [tokenizer.encode(records[i].prompt) for i in indices]
            assert rewards == [1.0, 0.0, 1.0, 0.0]
