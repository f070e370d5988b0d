"""The activation-memory model (`rlhf.profiling.activations`) against autograd: the bytes a tiny model's forward
really saves for its backward (`saved_tensors_hooks`, each storage counted once, parameters left out) equal the
model's flash-path estimate plus the CPU path's extra terms (`cpu_path_extra_bytes`), to the byte: packed and
padded, fused and full-logits heads, Llama (GQA), Qwen2 (MHA, qkv bias), Qwen3 (GQA, q/k norm), full recompute;
plus hand checks of the formula on a small shape."""

from __future__ import annotations

import pytest
import torch

from rlhf.errors import ConfigError
from rlhf.models.spec import ModelSpec
from rlhf.platform.packed_attention import length_buckets
from rlhf.profiling.activations import MicroBatchShape, activation_bytes, cpu_path_extra_bytes
from rlhf.testing.distributed import run_distributed
from tests.models.tiny import VOCAB, llama_config, qwen2_config, qwen3_config

PACKED = [300, 290, 40, 30]  # PackedDotProductAttention's length buckets: [300], [290], [40, 30 + 10 padding]
PADDED_ROWS, PADDED_LEN = 3, 96


def _saved_bytes(path: str, packed: bool, head: str, recompute: bool) -> int:
    """Bytes of the distinct storages autograd saves in one forward (+ the head's loss), parameters excluded."""
    from transformers import AutoConfig

    from rlhf.models.builder import build_gpt
    from rlhf.models.forward import padded_inputs, token_entropy, token_logprobs
    from rlhf.models.lm_head import LMHead, head_logprobs, hidden_output
    from rlhf.parallel.groups import GroupCache, build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.platform.packed_attention import packed_seq_params

    groups = build_layout_groups(ParallelLayout(), GroupCache())
    model = build_gpt(AutoConfig.from_pretrained(path), groups, recompute=recompute)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    held: list[torch.Tensor] = []  # no saved storage is freed and its address reused while counting

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
            held.append(tensor)
        return tensor

    gen = torch.Generator().manual_seed(0)
    if packed:
        tokens = torch.randint(0, VOCAB, (1, sum(PACKED)), generator=gen)
        positions = torch.cat([torch.arange(n) for n in PACKED])[None]
        cu_seqlens = torch.tensor([0, *torch.tensor(PACKED).cumsum(0).tolist()])
        inputs = dict(attention_mask=None, packed_seq_params=packed_seq_params(cu_seqlens, max(PACKED), groups.cp))
    else:
        tokens = torch.randint(0, VOCAB, (PADDED_ROWS, PADDED_LEN), generator=gen)
        positions, mask = padded_inputs(torch.ones_like(tokens, dtype=torch.bool))
        inputs = dict(attention_mask=mask)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        if head == "fused":
            with hidden_output(model):
                hidden_bsh = model(tokens, positions, **inputs)
            head_logprobs(hidden_bsh.reshape(-1, hidden_bsh.shape[-1]), tokens.reshape(-1),
                          LMHead.of(model, groups.tp, VOCAB), chunk_bytes=1 << 30)
        else:
            logits_bsv = model(tokens, positions, **inputs)
            token_logprobs(logits_bsv, tokens, groups.tp, VOCAB)
            token_entropy(logits_bsv, groups.tp, VOCAB)
    return sum(seen.values())


def _measure(folders: dict[str, str]) -> dict:
    cases = [(name, packed, head, False) for name in folders for packed in (True, False) for head in ("fused", "full")]
    cases.append(("llama", True, "fused", True))
    return {case: _saved_bytes(folders[case[0]], *case[1:]) for case in cases}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    configs = {"llama": llama_config(max_position_embeddings=1024), "qwen2": qwen2_config(max_position_embeddings=1024),
               "qwen3": qwen3_config(max_position_embeddings=1024)}
    folders = {}
    for name, config in configs.items():
        folders[name] = str(tmp_path_factory.mktemp(name))
        config.save_pretrained(folders[name])
    return configs, run_distributed(_measure, 1, folders, timeout_s=300)[0]


def test_saved_tensors_equal_the_flash_estimate_plus_the_cpu_extra(measured):
    configs, saved = measured
    for (name, packed, head, recompute), got in saved.items():
        if recompute:
            continue
        spec = ModelSpec.from_hf(configs[name])
        tokens = sum(PACKED) if packed else PADDED_ROWS * PADDED_LEN
        shape = MicroBatchShape(tokens=tokens, padded_rows=0 if packed else PADDED_ROWS, dtype_bytes=4, head=head)
        flash = activation_bytes(spec, shape).total_bytes
        assert length_buckets(PACKED) == [[0], [1], [2, 3]]  # the calls the packed core runs
        calls = PACKED if packed else [PADDED_LEN]
        extra = cpu_path_extra_bytes(spec, calls, batch=1 if packed else PADDED_ROWS, padded=not packed)
        assert got == flash + extra, (name, packed, head, got, flash, extra)


def test_full_recompute_keeps_each_layer_input(measured):
    configs, saved = measured
    spec = ModelSpec.from_hf(configs["llama"])
    tokens = sum(PACKED)
    estimate = activation_bytes(spec, MicroBatchShape(tokens=tokens, dtype_bytes=4, recompute="full"))
    kept = estimate.total_bytes - estimate.per_layer_bytes  # the rebuilt layer exists only in the backward
    rope_table = max(PACKED) * spec.head_dim * 4  # fp32, checkpointed with every layer's input (one storage)
    assert saved[("llama", True, "fused", True)] == kept + rope_table  # the final norm keeps x and rstd, as counted


def test_formula_by_hand_on_a_small_shape():
    """h 64, f 96, 4 heads / 2 kv heads of 16, 4 layers, vocab 101, bf16: each term written out."""
    spec = ModelSpec.from_hf(llama_config())
    h, f, q, kv, hd, heads = 64, 96, 64, 32, 16, 4
    per_token = (4 * h + 2 * q + 2 * kv + 4 * hd + 5 * f) * 2 + 4 * (2 + heads)
    assert per_token == 2008
    one = activation_bytes(spec, MicroBatchShape(tokens=1000, dtype_bytes=2))
    head = 1000 * (h * 2 + 4) + 1000 * (h * 2 + 17) + 1000 * VOCAB * 4
    assert (one.per_layer_bytes, one.layers_bytes, one.ends_bytes) == (1000 * per_token, 4 * 1000 * per_token,
                                                                       8 * 1000 + head)
    # tp2: heads, kv heads and f halve, h does not; cp2 halves the tokens; the vocab chunk caps the head
    tp2 = (4 * h + q + kv + 4 * hd + 5 * f // 2) * 2 + 4 * (2 + heads // 2)
    split = activation_bytes(spec, MicroBatchShape(tokens=1000, dtype_bytes=2, tp=2, cp=2, head_chunk_bytes=4096))
    assert split.per_layer_bytes == 500 * tp2
    assert split.ends_bytes == 8 * 500 + 500 * (h * 2 + 4) + 500 * (h * 2 + 17) + 4096
    # sequence parallel also splits the h terms
    sp = activation_bytes(spec, MicroBatchShape(tokens=1000, dtype_bytes=2, tp=2, sequence_parallel=True))
    assert sp.per_layer_bytes == 1000 * ((2 * h + q + kv + 4 * hd + 5 * f // 2) * 2 + 4 * (2 + heads // 2))
    # pp2, 4 micro-batches: stage 0 holds 2 in flight of its 2 layers (token ids, no head); stage 1 one + head
    first = activation_bytes(spec, MicroBatchShape(tokens=1000, dtype_bytes=2, pp=2, micro_batches=4))
    last = activation_bytes(spec, MicroBatchShape(tokens=1000, dtype_bytes=2, pp=2, pp_rank=1, micro_batches=4))
    assert (first.layers, first.in_flight, first.layers_bytes, first.ends_bytes) == (2, 2, 4000 * per_token, 16000)
    assert (last.in_flight, last.layers_bytes, last.ends_bytes) == (1, 2000 * per_token, head)
    # full recompute: 4 layer inputs + one layer rebuilt; selective drops the lse; forward-only keeps one layer
    full = activation_bytes(spec, MicroBatchShape(tokens=1000, dtype_bytes=2, recompute="full"))
    assert full.layers_bytes == 4 * 1000 * h * 2 + 1000 * per_token
    selective = activation_bytes(spec, MicroBatchShape(tokens=1000, dtype_bytes=2, recompute="selective"))
    assert selective.per_layer_bytes == 1000 * (per_token - 4 * heads)
    forward = activation_bytes(spec, MicroBatchShape(tokens=1000, dtype_bytes=2, train=False))
    assert forward.layers_bytes == 1000 * per_token and forward.ends_bytes == 8000 + head


def test_bad_shape_is_a_config_error():
    with pytest.raises(ConfigError, match="recompute=some is not one of none, full, selective"):
        MicroBatchShape(tokens=8, recompute="some")
