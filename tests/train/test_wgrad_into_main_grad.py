"""The embedding's and the fused LM head's weight gradients go straight into the DDP grad buffer (`main_grad`,
no dense [vocab, hidden] `.grad` per micro-batch): after a step the buffer holds transformers' gradient.

Tied embeddings (Qwen2: the head and the lookup share one weight, so both paths add into one buffer) and untied
(Llama), at tp1 and tp2 (vocab rows split over the ranks, 101 padded to 102), two micro-batches each.
"""

from __future__ import annotations

import pytest
import torch

from rlhf.testing.distributed import run_distributed

ROWS, SEQ, MICRO = 4, 12, 2


def _tiny_folder(family: str, path: str) -> str:
    from rlhf.testing.tiny_models import tiny_hf_model

    tiny_hf_model(family, seed=0).save_pretrained(path)
    return path


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    from tests.train.helpers import sft_batch

    return sft_batch(ROWS, SEQ, seed=3)


def _hf_grads(path: str) -> dict[str, torch.Tensor]:
    """transformers' gradient of the same loss (answer-token NLL over the global count) on the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens, mask = _batch()
    logprobs = torch.log_softmax(model(tokens).logits[:, :-1], dim=-1)
    picked = logprobs.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    (-(picked * mask[:, 1:]).sum() / mask[:, 1:].sum()).backward()
    grads = {"embedding": model.model.embed_tokens.weight.grad, "fc2": model.model.layers[0].mlp.down_proj.weight.grad}
    if not model.config.tie_word_embeddings:
        grads["head"] = model.lm_head.weight.grad
    return grads


def _rank(path: str, tp: int) -> dict:
    from transformers import AutoConfig

    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import load_hf_weights
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.testing.engine_nll import sft_micro_batches, sft_step
    from rlhf.train.config import OptimConfig
    from rlhf.train.engine import TrainEngine

    groups = build_layout_groups(ParallelLayout(tp=tp, pp=1, dp=1))
    model = build_gpt(AutoConfig.from_pretrained(path), groups)
    load_hf_weights(model, path)
    engine = TrainEngine(model, groups, OptimConfig(lr=1e-4, clip_grad=1e9, total_steps=2))
    embedding = engine.module.embedding.word_embeddings
    switched = "forward" in vars(embedding)  # rlhf's lookup, not megatron's method
    tokens, mask = _batch()
    sft_step(engine, sft_micro_batches(tokens, mask, dp_rank=0, dp_size=1, num_micro_batches=MICRO), fused_head=True)
    grads = {"embedding": embedding.weight.main_grad.clone(),
             "fc2": engine.module.decoder.layers[0].mlp.linear_fc2.weight.main_grad.clone()}
    if not engine.module.share_embeddings_and_output_weights:
        grads["head"] = engine.module.output_layer.weight.main_grad.clone()
    return {"switched": switched, "rank": groups.tp.rank(), "grads": grads}


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied, untied
@pytest.mark.parametrize("tp", [1, 2])
def test_embedding_and_head_grads_in_main_grad_equal_transformers(tmp_path, family, tp):
    path = _tiny_folder(family, str(tmp_path / family))
    expected = _hf_grads(path)
    for result in run_distributed(_rank, tp, path, tp, timeout_s=300):
        assert result["switched"]
        rank = result["rank"]
        for name, got in result["grads"].items():
            want = expected[name]
            if name in ("embedding", "head"):  # vocab rows split over tp, the last shard padded
                rows = got.shape[0]
                padded = torch.nn.functional.pad(want, (0, 0, 0, rows * tp - want.shape[0]))
                want = padded[rank * rows:(rank + 1) * rows]
            elif tp > 1:  # down_proj: row-parallel, input columns split over tp
                cols = got.shape[1]
                want = want[:, rank * cols:(rank + 1) * cols]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{family} tp{tp} {name}")
