"""On-policy distillation's config and routes: each bad input is one line naming the value and the fix."""

from types import SimpleNamespace

import pytest

from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.data.records import PromptRecord
from rlhf.errors import ConfigError
from rlhf.orchestration.checks import check_teacher_tokenizers, teacher_folders
from rlhf.stages.distill_config import DistillConfig
from rlhf.stages.distill import route_teachers

RECORDS = [PromptRecord(prompt="1+2=", data_source=source, ground_truth="3", index=index)
           for index, source in enumerate(["reasoning_gym/chain_sum", "gsm8k", "reasoning_gym/chain_sum"])]


def test_routes_send_each_prompt_to_its_teacher(tmp_path):
    config = DistillConfig(enable=True, teacher_path=str(tmp_path / "a"), routes={"gsm8k": str(tmp_path / "b")})
    assert config.teacher_paths == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert route_teachers(config, RECORDS) == {0: 0, 1: 1, 2: 0}


@pytest.mark.parametrize("config, message", [
    (dict(routes={"gsm8kk": "b"}, teacher_path="a"),
     "algo.distill.routes names data_source 'gsm8kk', which no training prompt has (did you mean 'gsm8k'?); the "
     "training data sources are: gsm8k, reasoning_gym/chain_sum"),
    (dict(routes={"gsm8k": "b"}),
     "training prompt 0 has data_source 'reasoning_gym/chain_sum', which no teacher takes: add it to "
     "algo.distill.routes or set algo.distill.teacher_path"),
])
def test_bad_routes_are_one_line(config, message):
    with pytest.raises(ConfigError) as error:
        route_teachers(DistillConfig(enable=True, **config), RECORDS)
    assert str(error.value) == message


@pytest.mark.parametrize("fields, message", [
    (dict(coef=0.0), "algo.distill.coef=0.0 is out of range: the reverse-KL advantage's weight must be in (0, 100]; "
                     "e.g. 1.0"),
    (dict(coef=float("nan")), "algo.distill.coef=nan is out of range: the reverse-KL advantage's weight must be in "
                              "(0, 100]; e.g. 1.0"),
    (dict(coef=1e3), "algo.distill.coef=1000.0 is out of range: the reverse-KL advantage's weight must be in "
                     "(0, 100]; e.g. 1.0"),
    (dict(clip=-1.0), "algo.distill.clip=-1.0 must be >= 0 (0: no per-token clipping)"),
    (dict(mode="alon"), "unknown algo.distill.mode 'alon' (did you mean 'alone'?); choose one of: mix, alone"),
    (dict(enable=True), "algo.distill.enable=true needs a teacher: set algo.distill.teacher_path (or "
                        "algo.distill.routes: {data_source: folder})"),
])
def test_bad_config_is_one_line(fields, message):
    with pytest.raises(ConfigError) as error:
        DistillConfig(**fields)
    assert str(error.value) == message


def test_teacher_with_another_tokenizer_is_refused(tmp_path):
    student = build_char_tokenizer()
    build_char_tokenizer().save_pretrained(tmp_path / "same")
    build_char_tokenizer("0123456789+-*= ").save_pretrained(tmp_path / "other")
    cfg = SimpleNamespace(model=SimpleNamespace(path="/student"), algo=SimpleNamespace(distill=DistillConfig(
        enable=True, teacher_path=str(tmp_path / "same"), routes={"gsm8k": str(tmp_path / "other")})))
    assert teacher_folders(cfg) == [("algo.distill.teacher_path", str(tmp_path / "same")),
                                    ("algo.distill.routes.gsm8k", str(tmp_path / "other"))]
    with pytest.raises(ConfigError) as error:
        check_teacher_tokenizers(cfg, student)
    assert str(error.value) == (f"algo.distill.routes.gsm8k={str(tmp_path / 'other')!r} has another tokenizer than "
                                "the student (model.path='/student'): a teacher scores the student's token ids, so "
                                "distil from a teacher with the student's tokenizer")
