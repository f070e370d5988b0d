import torch

from rlhf.algo.entropy import entropy_from_logits


def test_matches_categorical_entropy():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)) * 5
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)
