"""With a real engine (transformers' generate on a tiny model): every sampled token's rollout logprob equals the
trainer-side recompute over the final multi-turn row, observation tokens in between."""

import torch

from rlhf.agents.config import TurnLimits
from rlhf.agents.rollout import MultiTurnRollout
from rlhf.agents.trajectory import Termination, TrajectoryBuilder
from rlhf.data.records import PromptRecord
from rlhf.rollout.hf_engine import HFEngine
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.testing.tiny_models import tiny_hf_model


def test_rollout_logprobs_equal_the_recompute_across_turns(chat_tokenizer):
    model = tiny_hf_model("llama", vocab_size=128)
    engine = HFEngine(model, eos_token_ids=(chat_tokenizer.eos_token_id,))

    async def three_turns(ctx, sample):  # the observation after each turn is a fixed user message
        messages = [{"role": "user", "content": sample.prompt}]
        builder = TrajectoryBuilder(prompt=ctx.renderer.prompt(messages), token_budget=512)
        for turn in range(3):
            generation = await ctx.generate(builder.tokens, 6)
            builder.add_sampled(generation.token_ids, generation.logprobs, generation.policy_version)
            messages.append({"role": "assistant", "content": chat_tokenizer.decode(generation.token_ids)})
            builder.add_observation(ctx.renderer.delta([{"role": "user", "content": f"go on {turn}"}]))
        return builder.finish(Termination.MAX_TURNS, num_turns=3)

    rollout = MultiTurnRollout(chat_tokenizer, TurnLimits(), agent=three_turns)
    records = [PromptRecord(prompt=q, data_source="t", ground_truth=None, index=i)
               for i, q in enumerate(["abc", "hello there"])]
    result = rollout.collect(engine, records, SamplingParams(max_new_tokens=6, n=2, seed=5), pad_token_id=0)
    assert result.stats.rows_per_call == [4, 4, 4]
    for group in result.groups:
        for traj in group.trajectories:
            (row,) = traj.rows
            tokens = torch.tensor([row.tokens])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(tokens).logits[0].float(), dim=-1)
            positions = range(row.prompt_length - 1, len(row.tokens) - 1)
            recomputed = [float(logprobs[p, row.tokens[p + 1]]) for p in positions]
            sampled = [i for i, m in enumerate(row.loss_mask) if m]
            assert len(sampled) == row.num_sampled > 3
            assert max(abs(recomputed[i] - row.logprobs[i]) for i in sampled) < 1e-5
            assert all(row.logprobs[i] == 0.0 for i, m in enumerate(row.loss_mask) if not m)
