"""The data path as DP ranks run it: shared file → per-rank sampler slice → tokens → rewards, on 2 gloo ranks."""

import torch.distributed as dist

from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.data.make import MakeConfig, make_dataset
from rlhf.data.records import read_records
from rlhf.data.sampler import PromptSampler
from rlhf.data.tokenize import PromptLengthConfig, tokenize_records
from rlhf.rewards.registry import RewardConfig, RuleReward
from rlhf.testing.distributed import run_distributed

STEPS, GLOBAL_BATCH = 5, 8


def _rank_steps(path):
    rank, world = dist.get_rank(), dist.get_world_size()
    prompts = tokenize_records(read_records(path), build_char_tokenizer(), PromptLengthConfig(max_prompt_length=16))
    sampler = PromptSampler(num_samples=len(prompts.records), global_batch_size=GLOBAL_BATCH, dp_rank=rank,
                            dp_size=world, seed=1234)
    reward = RuleReward(RewardConfig(by_source={"reasoning_gym/*": "reasoning_gym_exact"}))
    steps = []
    for _ in range(STEPS):
        indices = sampler.next_indices()
        records = [prompts.records[i] for i in indices]
        responses = [r.ground_truth if n % 2 == 0 else r.ground_truth + "1" for n, r in enumerate(records)]
        steps.append((indices, [prompts.token_ids[i] for i in indices], reward.score(records, responses).tolist()))
    gathered = [None] * world
    dist.all_gather_object(gathered, steps)
    return gathered, sampler.state_dict()


def test_ranks_take_disjoint_slices_of_the_global_batches(tmp_path):
    path = tmp_path / "train.parquet"
    make_dataset(MakeConfig(task="chain_sum", num_samples=30, seed=5, prompt_format="expression",
                            task_config={"max_terms": 3, "max_digits": 2}), path)
    results = run_distributed(_rank_steps, 2, str(path), timeout_s=180)
    (gathered, state0), (_, state1) = results
    assert state0 == state1 and state0["epoch"] == 1  # 30 prompts = 3 batches of 8: step 5 is in epoch 1
    reference = PromptSampler(num_samples=30, global_batch_size=GLOBAL_BATCH, dp_rank=0, dp_size=1, seed=1234)
    tokenizer = build_char_tokenizer()
    records = read_records(path)
    for step in range(STEPS):
        rank0, rank1 = gathered[0][step], gathered[1][step]
        assert rank0[0] + rank1[0] == reference.next_indices()
        assert not set(rank0[0]) & set(rank1[0])
        for indices, token_ids, rewards in (rank0, rank1):
            assert token_ids == [tokenizer.encode(records[i].prompt) for i in indices]
            assert rewards == [1.0, 0.0, 1.0, 0.0]
