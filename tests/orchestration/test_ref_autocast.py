"""`ref.autocast`: the reference's forwards under the actor's bf16 autocast (auto) see the same numerics as the
actor's update, so on the first batch (actor = reference) the KL loss is exactly 0, with LoRA too (the reference
is the actor's base); with `ref.autocast=none` the fp32 reference differs from the bf16 actor by bf16 rounding.
Bad values are one-line ConfigErrors."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer, trainer_config  # noqa: E402

from rlhf.errors import ConfigError  # noqa: E402
from rlhf.platform import host_supports_bf16  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=16, num_val=4)


def _runs(paths, root):
    common = ["actor.optim.autocast=bfloat16", "algo.kl.coef=0.1", "trainer.total_steps=1",
              "trainer.val_before_train=false"]
    lora = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8"]  # the reference: the actor's base, adapters off
    runs = {mode: run_trainer(paths, f"{root}/{mode}", [*common, f"ref.autocast={mode}", f"run.name={mode}"])[-1]
            for mode in ("auto", "none")}
    runs["lora"] = run_trainer(paths, f"{root}/lora", [*common, *lora, "run.name=lora"])[-1]
    return runs


@pytest.mark.skipif(not host_supports_bf16(), reason="this CPU has no native bf16 matmuls (AVX-512-BF16/AMX)")
def test_reference_follows_the_actors_autocast(tiny, tmp_path):
    last = run_distributed(_runs, 2, tiny, str(tmp_path), timeout_s=400)[0]
    assert last["auto"]["step"] == last["none"]["step"] == 1
    assert last["auto"]["actor/kl_loss"] == 0.0  # same bf16 forward on the same weights
    assert last["none"]["actor/kl_loss"] > 0.0  # fp32 reference vs bf16 actor (k3 KL ~ rounding squared)
    assert last["lora"]["actor/kl_loss"] == 0.0  # LoRA: adapters start at zero, the base under the same autocast


def test_bad_ref_autocast_is_one_line(tiny, tmp_path):
    with pytest.raises(ConfigError, match=re.escape("ref.autocast='fp16' is not one of auto, none, bfloat16")):
        trainer_config(tiny, str(tmp_path), ["ref.autocast=fp16"])
