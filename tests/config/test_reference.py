"""docs/config.md is the config tree as the dataclasses define it: every key described, enums listed, not stale."""

from __future__ import annotations

from pathlib import Path

from rlhf.orchestration.schema import RlhfConfig
from rlhf.config.reference import render, sections

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _keys() -> dict:
    return {key.path: key for section in sections(RlhfConfig, instance=RlhfConfig()) for key in section.keys}


def test_reference_page_is_current():
    assert PAGE.read_text() == render(RlhfConfig), "docs/config.md is stale: run `rlhf config --reference docs/config.md`"


def test_every_key_is_described_with_type_default_and_choices():
    keys = _keys()
    assert len(keys) > 140
    assert [path for path, key in keys.items() if not key.meaning] == []
    assert keys["algo.advantage.kind"].choices == ("`gae`, `grpo`, `rloo`, `reinforce_plus_plus`, "
                                                   "`reinforce_plus_plus_baseline`, `remax`, `opo`, `gpg`, "
                                                   "`grpo_passk`, `gdpo`, `optimal_token_baseline`")
    assert keys["dist.backend"].choices == "`auto`, `gloo`, `nccl`"  # from the tuple __post_init__ checks
    assert keys["model.dtype"].choices == "`float32`, `bfloat16`"
    assert keys["mesh.roles"].choices == "`actor`, `critic`, `ref`, `reward`, `rollout`, `teacher`"  # checked per item
    assert keys["algo.rollout_correction.enable"].choices == "`true`, `false`, `auto`"
    assert keys["actor.optim.lr"][1:4] == ("float", "`1e-06`", "")
    assert keys["reward.remote.url"].default == "required"  # a section that is null by default is listed too
    assert keys["comm.step_timeout_s"].meaning.startswith("watchdog deadline")  # a trailing field comment
    assert keys["actor.recompute_old_logprobs"].meaning.startswith("actor: auto runs")  # a comment above the field
