"""`rlhf sft` (rlhf.orchestration.sft): the first step's loss is transformers' answer NLL of the same batch, the same
losses with the fused LM head and with full logits at TP2, the loss falls, validation runs, and the exported folder
loads in transformers with the trained weights."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=32, num_val=4)


def _sft_runs(paths, root):
    from rlhf.run_dir import close_run, setup_run
    from rlhf.orchestration.sft import run_sft

    out = {}
    for fused in (True, False):
        cfg = trainer_config(paths, root, ["mesh.actor.tp=2", "sft.steps=4", "sft.batch_size=8",
                                           "actor.micro_batch_size=4", f"model.fused_head={fused}",
                                           f"run.name=sft_{fused}", f"sft.out_dir={root}/export_{fused}"])
        run_dir = setup_run(cfg.run, cfg, prefix="sft")
        try:
            out[fused] = (run_sft(cfg, cfg.sft, run_dir), str(run_dir.path))
        finally:
            close_run()
    return out


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

    runs = run_distributed(_sft_runs, 2, tiny, str(tmp_path), timeout_s=300)[0]
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
