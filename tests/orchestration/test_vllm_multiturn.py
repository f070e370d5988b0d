"""Multi-turn GRPO with real vLLM as the rollout engine on 2 gloo ranks (`make test-vllm`): the user agent of
test_multiturn_run (three turns, a user observation naming the rank that rendered it) at rollout tp=2 (TP rank 0
runs the agents and relays each turn's prompts) and at tp=1 x dp=2, and the built-in tool loop. vLLM is
token-in/token-out (`prompt_token_ids` in, token ids out), so in fp32 the trainer's recompute of the sampled
tokens equals vLLM's logprobs across the interior zeros."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_multiturn_run import fit_run, make_multiturn_setup, multiturn_config  # noqa: E402

from rlhf.data.char_tokenizer import build_chat_char_tokenizer  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="needs vLLM: make install-vllm")]

VLLM = ["rollout.engine=vllm", "rollout.vllm.enforce_eager=true", "rollout.vllm.kv_cache_gb=0.25",
        "model.dtype=float32", "sampling.temperature=0.8", "trainer.total_steps=2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # vLLM's CPU attention needs head_dim >= 32
    return make_multiturn_setup(tmp_path_factory.mktemp("vllm_multiturn"), hidden_size=64, num_heads=2,
                                num_kv_heads=2, intermediate_size=128)


def _runs(setup, root):
    import torch.distributed as dist

    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.preflight import preflight

    agent = f"multiturn.agent={setup['agent']}:three_turns"
    out = {}
    for name, overrides in (("tp2", [agent, "mesh.rollout.tp=2"]), ("dp2", [agent]),
                            ("tools", ["multiturn.agent=tools", f"multiturn.tool_config={setup['tools']}",
                                       "multiturn.list_tools=false"])):
        cfg = multiturn_config(setup, f"{root}/{name}", VLLM + overrides)
        preflight(cfg, dist.get_world_size())
        out[name] = fit_run(cfg, Trainer)
    return out


def test_multiturn_grpo_with_vllm_at_tp2_and_dp2(setup, tmp_path):
    world = run_distributed(_runs, 2, setup, str(tmp_path), env={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout_s=1500)
    tp2, dp2, tools = world[0]["tp2"], world[0]["dp2"], world[0]["tools"]
    for row in tp2["history"][1:] + dp2["history"][1:]:
        assert row["multiturn/turns_mean"] == 3.0 and row["multiturn/generate_calls"] == 3.0
        assert row["multiturn/prefix_mismatch"] == 0.0 and row["multiturn/termination/max_turns"] == 1.0
        assert row["rollout/logprob_diff_max"] <= 1e-5  # vLLM's logprobs = the trainer's, across interior zeros
    tokenizer = build_chat_char_tokenizer()
    for batch in tp2["batches"]:
        texts = [tokenizer.decode(row.tolist()) for row in batch.tokens_bs]
        assert all("again 0 r0" in text and "again 1 r0" in text and " r1" not in text for text in texts)
    for batch in tp2["batches"] + dp2["batches"]:
        assert batch.size == 8
        sampled_b = batch.loss_mask_bt.sum(-1)
        assert (sampled_b <= 12).all() and (sampled_b < batch.response_lengths_b).all()  # user turns are zeros
        assert torch.equal(batch.rollout_logprobs_bt != 0, batch.loss_mask_bt)
    for row in tools["history"][1:]:
        assert row["multiturn/dropped_groups"] == 0.0 and "multiturn/engine_idle_share" in row
