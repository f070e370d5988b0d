"""Startup checks (seed 004): sampling that cannot generate fails at config load, a reward model tokenizer that
pads or ends differently from the policy's fails in preflight, a reward model without a score head is a warning."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402

from rlhf.config import from_dict  # noqa: E402
from rlhf.orchestration.schema import RlhfConfig
from rlhf.data.loader import load_prompts  # noqa: E402
from rlhf.errors import ConfigError  # noqa: E402
from rlhf.orchestration.checks import input_warnings, load_tokenizer, score_head_warning  # noqa: E402
from rlhf.orchestration.preflight import preflight  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=16, num_val=4)


@pytest.fixture(scope="module")
def reward_models(tiny, tmp_path_factory):
    """A trained-looking reward model (score head) with the policy's tokenizer, and one whose eos differs."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("rm")
    config = AutoConfig.from_pretrained(tiny["model"], num_labels=1, pad_token_id=0)
    model = AutoModelForSequenceClassification.from_config(config).float()
    tokenizer = load_tokenizer(tiny["model"])
    model.save_pretrained(root / "same")
    tokenizer.save_pretrained(root / "same")
    model.save_pretrained(root / "other_eos")
    tokenizer.eos_token = "<bos>"
    tokenizer.save_pretrained(root / "other_eos")
    return {"same": str(root / "same"), "other_eos": str(root / "other_eos")}


@pytest.mark.parametrize("sampling, message", [
    ({"temperature": 0, "top_p": 0}, r"^sampling\.temperature=0 \(greedy\) with sampling\.top_p=0 cannot generate: "
                                     r"top_p=0 keeps no token; use top_p=1\.0 \(top_p is ignored when greedy\) or a "
                                     r"value in \(0, 1\]$"),
    ({"top_p": 0.0}, r"^sampling\.temperature=1 with sampling\.top_p=0 cannot generate"),
    ({"max_new_tokens": 0}, r"^sampling\.max_new_tokens=0 cannot generate: every response needs at least one token; "
                            r"set it >= 1$"),
    ({"n": 0}, r"^sampling\.n=0 and sampling\.val_n=1 \(samples per prompt\) must be >= 1$"),
    ({"val_n": 4}, r"^sampling\.val_n=4 with sampling\.val_temperature=0 \(greedy\) gives 4 identical responses per "
                   r"prompt; use sampling\.val_n=1 or sampling\.val_temperature > 0$"),
    ({"temperature": -1.0}, r"temperature=-1\.0 is negative; use temperature=0 for greedy"),
    ({"temperature": 0, "n": 4}, r"temperature=0 \(greedy\) with n=4 gives 4 identical responses per prompt"),
])
def test_sampling_that_cannot_generate_fails_at_config_load(sampling, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(RlhfConfig, {"sampling": sampling})


def test_reward_model_tokenizer_must_pad_and_end_like_the_policy(tiny, reward_models, tmp_path):
    same = trainer_config(tiny, str(tmp_path), [f"reward.model_path={reward_models['same']}"])
    preflight(same, 1)
    other = trainer_config(tiny, str(tmp_path / "other"), [f"reward.model_path={reward_models['other_eos']}"])
    with pytest.raises(ConfigError) as error:
        preflight(other, 1)
    assert str(error.value) == (
        f"reward.model_path={reward_models['other_eos']!r} has eos_token_id=2 but the policy's tokenizer (model.path="
        f"{tiny['model']!r}) has eos_token_id=3: the reward model scores the policy's tokens, so it must use the same "
        "tokenizer; train the reward model from the policy's tokenizer, or, if the vocabularies are the same, copy "
        "model.path's tokenizer files into the reward model folder")
    assert not (tmp_path / "other").exists(), "preflight writes nothing"


def test_a_reward_model_without_score_head_is_one_warning(tiny, reward_models, tmp_path):
    trained = trainer_config(tiny, str(tmp_path), [f"reward.model_path={reward_models['same']}"])
    assert score_head_warning(trained) is None
    lm_folder = trainer_config(tiny, str(tmp_path), [f"reward.model_path={tiny['model']}"])
    tokenizer = load_tokenizer(tiny["model"])
    train = load_prompts([tiny["train"]], tokenizer, lm_folder.data)
    assert input_warnings(lm_folder, tokenizer, train, None) == [
        f"reward.model_path={tiny['model']!r} has no score head (score.weight), so the reward model's head is "
        "randomly initialised and its rewards are noise; point reward.model_path at a trained reward model "
        "(e.g. AutoModelForSequenceClassification with num_labels=1)"]
