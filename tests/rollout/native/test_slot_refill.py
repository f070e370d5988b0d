"""Slot bookkeeping of one `generate` with scripted tokens: refill, stops, lengths, the attended context,
and a slot that stays free while another row runs on never reads or writes past the KV cache."""

import torch

from rlhf.rollout.native import generation
from rlhf.rollout.native.kv_cache import KVCache
from rlhf.rollout.native.sampler import Sampled
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import FinishReason, PromptBatch

VOCAB, STOP, MAX_SEQ = 11, 7, 10


class _Decoder:
    """Stands in for the forward: records every position it is asked to write."""

    max_prefill_tokens = 8192

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.contexts: list[int] = []

    def prefill(self, packed, cache, routing=None):
        return torch.zeros(len(packed.prompts), VOCAB)

    def decode(self, tokens_s, positions_s, context, cache, routing=None):
        self.positions.extend(positions_s.tolist())
        self.contexts.append(context)
        return torch.zeros(tokens_s.shape[0], VOCAB)


def test_a_slot_left_free_stays_inside_the_cache(monkeypatch):
    # 2 slots, 3 prompts. P0 (6 tokens) and P1 start; P1 stops at its 3rd token, P2 refills its slot at
    # decode step 2; P0 ends by length after step 2 and its slot stays free (nothing pending) while P2 runs
    # steps 3-4: without care that free slot would be fed positions 9, 10 in a 10-position cache.
    script = iter([[1, 1],  # first tokens of P0, P1 (prefill)
                   [1, 1], [1, STOP],  # decode steps 0, 1
                   [1],  # first token of P2 (prefill into P1's slot)
                   [1, 1], [1, 1], [1, 1]])  # decode steps 2, 3, 4

    def scripted(logits_kv, params, generator):
        tokens = torch.tensor(next(script))
        assert tokens.shape[0] == logits_kv.shape[0]
        return Sampled(tokens, torch.zeros(len(tokens)), torch.zeros(len(tokens)))

    monkeypatch.setattr(generation, "sample", scripted)
    decoder = _Decoder()
    cache = KVCache(num_layers=1, num_slots=2, num_kv_heads=1, max_seq_len=MAX_SEQ, head_dim=2,
                    dtype=torch.float32, device=torch.device("cpu"))
    prompts = PromptBatch.from_token_lists([[3] * 6, [4, 5], [6, 6]])
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(STOP,))
    out = generation.Generation(decoder, cache, prompts, params, (STOP,), torch.Generator()).run(0)
    assert [out.response(i) for i in range(3)] == [[1, 1, 1, 1], [1, 1, STOP], [1, 1, 1, 1]]
    assert out.finish_reasons == [FinishReason.LENGTH, FinishReason.STOP, FinishReason.LENGTH]
    assert max(decoder.positions) < MAX_SEQ and len(decoder.positions) == 10  # 5 steps x 2 slots
    # Attended context = 1 + the highest live position: P0 at 6, 7, 8, then P2 alone at 3, 4.
    assert decoder.contexts == [7, 8, 9, 4, 5]
