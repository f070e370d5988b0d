"""Packs filled to the row count the platform's GEMMs pad to (`rlhf.platform.gemm.fill_rows`): at tp = cp = 1 with
fp32 compute on CPU each packed micro-batch gets a filler sequence up to `gemm.padded_rows` of its tokens, outside
every loss (padding, never wanted) and leaving the real tokens where they were; other dtypes, devices, layouts, or
no compute dtype, no filler, nor for models whose linears are below `gemm.MIN_MACS` (torch's GEMMs, unpadded). `ModelRole` passes its
compute dtype (autocast's, else its weights') and hidden size."""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_roles import fixed_batch  # noqa: E402

from rlhf.platform import gemm  # noqa: E402
from rlhf.stages.micro_batches import pack_plan, packed_micro_batches, row_lengths  # noqa: E402
from rlhf.testing.distributed import FakeGroup  # noqa: E402


WIDE = 1024  # a hidden size whose linears take oneDNN even on these short packs


def _pgs(tp: int = 1):
    return SimpleNamespace(tp=FakeGroup(tp, 0), cp=FakeGroup(1, 0), pp=FakeGroup(1, 0), ep=FakeGroup(1, 0))


def test_fill_rows_follows_the_gemms_padding(monkeypatch):
    cpu = torch.device("cpu")
    assert gemm.fill_rows(1221, torch.float32, cpu, 64) == (1280 if gemm.ENABLED else 1221)
    assert gemm.fill_rows(1221, torch.bfloat16, cpu, 64) == 1221
    assert gemm.fill_rows(1221, torch.float32, torch.device("cuda"), 64) == 1221
    assert gemm.fill_rows(1221, torch.float32, cpu, 16) == 1221  # 1221 x 16 x 16 < MIN_MACS: torch's GEMMs
    monkeypatch.setattr(gemm, "ENABLED", False)
    assert gemm.fill_rows(1221, torch.float32, cpu, 64) == 1221


def test_fp32_packs_get_a_filler_sequence_outside_every_loss(monkeypatch):
    monkeypatch.setattr(gemm, "ENABLED", True)
    batch = fixed_batch(24)
    bins = pack_plan(row_lengths(batch), 1, 40, "budget")[0]
    plain = packed_micro_batches(batch, bins, _pgs())
    filled = packed_micro_batches(batch, bins, _pgs(), torch.float32, WIDE)
    assert [mb.tokens_bs.shape[1] for mb in packed_micro_batches(batch, bins, _pgs(), torch.bfloat16, WIDE)] == \
        [mb.tokens_bs.shape[1] for mb in plain]
    assert [mb.tokens_bs.shape[1] for mb in packed_micro_batches(batch, bins, _pgs(tp=2), torch.float32, WIDE)] == \
        [mb.tokens_bs.shape[1] for mb in plain]
    grew = 0
    for before, after in zip(plain, filled):
        real = before.tokens_bs.shape[1]
        assert after.tokens_bs.shape[1] == gemm.padded_rows(real)
        grew += after.tokens_bs.shape[1] > real
        assert torch.equal(after.tokens_bs[:, :real], before.tokens_bs)
        assert torch.equal(after.position_ids_bs[:, :real], before.position_ids_bs)
        assert torch.equal(after.cu_seqlens_n[:len(before.cu_seqlens_n)], before.cu_seqlens_n)
        assert after.padding_mask_bs[0, real:].all() and not after.wanted_bs[0, real:].any()
        assert torch.equal(after.wanted_bs[:, :real], before.wanted_bs)
        output = torch.randn(1, after.tokens_bs.shape[1], 3)
        assert torch.equal(after.unpack(output), before.unpack(output[:, :real]))
    assert grew > 0  # the batch's packs are not all at a padded size already
