"""Bad input to `rlhf train` fails before anything is written, with a one-line error naming the value."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402

from rlhf.data.loader import load_prompts  # noqa: E402
from rlhf.errors import CheckpointError, ConfigError, DataError  # noqa: E402
from rlhf.orchestration.checks import input_warnings, load_tokenizer  # noqa: E402
from rlhf.orchestration.preflight import preflight  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=16, num_val=4)


def test_inconsistent_batch_sizes(tiny, tmp_path):
    preflight(trainer_config(tiny, str(tmp_path), ["actor.micro_batch_size=3"]), world_size=2)  # packed: any rows
    cfg = trainer_config(tiny, str(tmp_path), ["actor.micro_batch_size=3", "actor.max_tokens_per_microbatch=0"])
    with pytest.raises(ConfigError, match=r"^actor: 16 rollouts per step \(data\.prompts_per_step=4 x sampling\.n=4\) "
                                          r"must split into actor\.mini_batches=1 x dp=2 x micro-batches of "
                                          r"actor\.micro_batch_size=3"):
        preflight(cfg, world_size=2)
    cfg = trainer_config(tiny, str(tmp_path), ["data.prompts_per_step=3"])
    with pytest.raises(ConfigError, match=r"^data\.prompts_per_step=3 is not divisible by the rollout dp size 2"):
        preflight(cfg, world_size=2)
    cfg = trainer_config(tiny, str(tmp_path), ["sampling.n=1", "actor.micro_batch_size=2"])
    with pytest.raises(ConfigError, match=r"^algo\.advantage\.kind=grpo compares the samples of one prompt"):
        preflight(cfg, world_size=2)


def test_missing_model_and_ground_truth_and_long_prompt(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.path='/nope' is not a folder"):
        preflight(trainer_config(tiny, str(tmp_path), ["model.path=/nope"]), world_size=1)
    rows = [json.loads(line) for line in Path(tiny["train"]).read_text().splitlines()]
    del rows[2]["reward_model"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"bad\.jsonl:3"):
        preflight(trainer_config(tiny, str(tmp_path), [f"data.train_files=[{bad}]"]), world_size=1)
    bad.write_text(Path(tiny["train"]).read_text() + "{not json\n")
    with pytest.raises(DataError, match=rf"bad\.jsonl:{len(rows) + 1}"):
        preflight(trainer_config(tiny, str(tmp_path), [f"data.train_files=[{bad}]"]), world_size=1)
    with pytest.raises(DataError, match=r"> data\.max_prompt_length=2; raise the limit"):
        preflight(trainer_config(tiny, str(tmp_path), ["data.max_prompt_length=2"]), world_size=1)


def test_unknown_reward_source_and_algorithm(tiny, tmp_path):
    rows = [json.loads(line) for line in Path(tiny["train"]).read_text().splitlines()]
    rows[5]["data_source"] = "mystery"
    odd = tmp_path / "odd.jsonl"
    odd.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ConfigError, match=r"^no reward function for data_source 'mystery'; map it in reward\.by_source"):
        preflight(trainer_config(tiny, str(tmp_path), [f"data.train_files=[{odd}]"]), world_size=1)
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'ppo2' \(did you mean 'ppo'\?\); "
                                          r"choose one of: gae, grpo"):
        trainer_config(tiny, str(tmp_path), ["algo.advantage.kind=ppo2"])


def test_reward_model_conflicts(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"^algo\.advantage\.kind=remax scores a greedy baseline with rule rewards"):
        preflight(trainer_config(tiny, str(tmp_path), ["algo.advantage.kind=remax",
                                                       f"reward.model_path={tiny['model']}"]), world_size=1)
    with pytest.raises(ConfigError, match=r"^reward\.model_path='/nope' is not a folder"):
        preflight(trainer_config(tiny, str(tmp_path), ["reward.model_path=/nope"]), world_size=1)


def test_cli_one_line_error_and_nothing_written(tiny, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tiny['model']}}}\ndata: {{train_files: [{tiny['train']}], prompts_per_step: 4}}\n"
                   f"run: {{output_dir: {tmp_path / 'runs'}}}\n"
                   "actor: {micro_batch_size: 3, max_tokens_per_microbatch: 0}\n"  # row counts
                   "dist: {backend: gloo}\nsampling: {max_new_tokens: 8}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "rlhf", "train", "--config", str(cfg)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("rlhf train: error: actor: 16 rollouts per step")
    assert not (tmp_path / "runs").exists()


def test_dropping_weights_the_engine_shares_with_the_actor(tiny, tmp_path):
    cfg = trainer_config(tiny, str(tmp_path), ["rollout.sleep=kv_cache_and_weights"])
    with pytest.raises(ConfigError, match=r"^rollout\.sleep=kv_cache_and_weights would free the weights the native "
                                          r"engine shares with the actor \(same layout\)"):
        preflight(cfg, world_size=2)
    preflight(trainer_config(tiny, str(tmp_path), ["rollout.sleep=kv_cache_and_weights", "mesh.actor.tp=2",
                                                   "mesh.rollout.tp=1"]), world_size=2)


def test_dynamic_sampling_with_a_reward_model_and_bad_rollout_dtype(tiny, tmp_path):
    cfg = trainer_config(tiny, str(tmp_path), ["algo.filter_groups.enable=true", f"reward.model_path={tiny['model']}"])
    with pytest.raises(ConfigError, match=r"^algo\.filter_groups\.enable=true filters groups on rule rewards before "
                                          r"training; it cannot be combined with reward\.model_path yet$"):
        preflight(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"^rollout\.dtype='float16' is not one of 'auto', 'float32', 'bfloat16'$"):
        trainer_config(tiny, str(tmp_path), ["rollout.dtype=float16"])
    with pytest.raises(ConfigError, match=r"^algo\.rollout_correction\.bypass_mode=true anchors PPO"):
        trainer_config(tiny, str(tmp_path), ["algo.rollout_correction.bypass_mode=true"])


def _copy_model(tiny, tmp_path, name, drop=()):
    folder = tmp_path / name
    shutil.copytree(tiny["model"], folder, ignore=shutil.ignore_patterns(*drop))
    return folder


def test_model_folder_problems_are_one_line_naming_the_folder(tiny, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=rf"^model\.path='{empty}' has no config\.json, so it is not an HF model "
                                          r"folder; point it at one"):
        preflight(trainer_config(tiny, str(tmp_path), [f"model.path={empty}"]), world_size=1)
    broken = _copy_model(tiny, tmp_path, "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=rf"^model\.path='{broken}': transformers cannot read its config\.json "
                                          r"\(It looks like the config file at .* is not a valid JSON file\.\); "
                                          r"fix the file or re-export the folder$"):
        preflight(trainer_config(tiny, str(tmp_path), [f"model.path={broken}"]), world_size=1)
    other = _copy_model(tiny, tmp_path, "gpt2")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"^unsupported architecture model_type='gpt2'; supported: llama, mistral"):
        preflight(trainer_config(tiny, str(tmp_path), [f"model.path={other}"]), world_size=1)
    no_tokenizer = _copy_model(tiny, tmp_path, "no_tokenizer", drop=("tokenizer*",))
    with pytest.raises(ConfigError, match=rf"^model\.path='{no_tokenizer}' has no usable tokenizer \(.*\); copy the "
                                          r"base model's tokenizer files \(tokenizer\.json, tokenizer_config\.json\)"):
        preflight(trainer_config(tiny, str(tmp_path), [f"model.path={no_tokenizer}"]), world_size=1)
    truncated = _copy_model(tiny, tmp_path, "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=rf"^{weights} is not a readable safetensors file \(Error while "
                                              r"deserializing header: .*\); re-download or re-export the model"):
        preflight(trainer_config(tiny, str(tmp_path), [f"model.path={truncated}"]), world_size=1)


def test_output_folder_resume_path_kv_cache_and_dataset_size_are_checked_first(tiny, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match=rf"^run\.output_dir='{a_file}/runs': {a_file} is a file, not a folder"):
        preflight(trainer_config(tiny, f"{a_file}/runs"), world_size=1)
    with pytest.raises(ConfigError, match=r"^run\.output_dir='/proc/rlhf-runs': cannot write in /proc \(.*\); choose "
                                          r"a writable run\.output_dir$"):
        preflight(trainer_config(tiny, "/proc/rlhf-runs"), world_size=1)
    with pytest.raises(CheckpointError, match=r"^checkpoint\.resume='/nope/step_3' is not a complete checkpoint"):
        preflight(trainer_config(tiny, str(tmp_path), ["checkpoint.resume=/nope/step_3"]), world_size=1)
    with pytest.raises(ConfigError, match=r"^the longest prompt \(\d+ tokens\) \+ sampling\.max_new_tokens=5 needs "
                                          r"\d+ KV-cache positions but rollout\.native\.max_seq_len=8; raise "):
        preflight(trainer_config(tiny, str(tmp_path), ["rollout.native.max_seq_len=8"]), world_size=1)
    with pytest.raises(ConfigError, match=r"^sampling\.n=4 samples of one prompt need 4 KV-cache slots but "
                                          r"rollout\.native\.max_batch_size=2"):
        preflight(trainer_config(tiny, str(tmp_path), ["rollout.native.max_batch_size=2"]), world_size=1)
    with pytest.raises(ConfigError, match=r"^the dataset has 16 prompts, fewer than data\.prompts_per_step=32; "):
        preflight(trainer_config(tiny, str(tmp_path), ["data.prompts_per_step=32"]), world_size=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # the write probe left nothing


def test_export_to_an_unwritable_folder_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "rlhf", "export", "--run-dir", str(tmp_path),
                          "--out", "/proc/rlhf-hf"],
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 2, out.stderr[-2000:]
    assert re.fullmatch(r"rlhf export: error: --out='/proc/rlhf-hf': cannot write in /proc \(.*\); choose a "
                        r"writable --out", out.stderr.strip()), out.stderr


def test_resuming_into_another_model_is_one_line(tiny, tmp_path):
    """A checkpoint's weights (full tensors under HF names) are checked against the model before any is used."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from rlhf.models.hf_load import HfFolder, check_folder
    from rlhf.models.spec import ModelSpec

    spec = ModelSpec.from_hf(AutoConfig.from_pretrained(tiny["model"]))
    tensors = load_file(f"{tiny['model']}/model.safetensors")
    save_file(tensors | {"model.norm.weight": torch.ones(64)}, tmp_path / "actor_model_r0.safetensors")
    folder = HfFolder.of_files(str(tmp_path), {name: "actor_model_r0.safetensors" for name in tensors})
    with pytest.raises(CheckpointError, match=rf"^tensor 'model.norm.weight' in {tmp_path} has shape \[64\], "
                                              r"config expects \[32\]$"):
        check_folder(folder, spec)
    del folder.file_of["model.norm.weight"]
    with pytest.raises(CheckpointError, match=rf"^{tmp_path} is missing tensor 'model.norm.weight'"):
        check_folder(folder, spec)


def test_warnings_for_a_tokenizer_that_cannot_stop_and_unknown_characters(tiny, tmp_path):
    cfg = trainer_config(tiny, str(tmp_path))
    tokenizer = load_tokenizer(tiny["model"])
    rows = [json.loads(line) for line in Path(tiny["train"]).read_text().splitlines()]
    rows[3]["prompt"] = "4é+1="
    odd = tmp_path / "odd.jsonl"
    odd.write_text("\n".join(json.dumps(r) for r in rows))
    train = load_prompts([str(odd)], tokenizer, cfg.data)
    assert input_warnings(cfg, tokenizer, train, None) == [
        "1 of 16 prompts in data.train_files hold characters outside the tokenizer's vocabulary (1 tokens became "
        "'<unk>'; first: record index 3); check that the tokenizer matches the data"]
    tokenizer.pad_token, tokenizer.eos_token = None, None
    assert input_warnings(cfg, tokenizer, load_prompts([tiny["train"]], tokenizer, cfg.data), None) == [
        f"the tokenizer of model.path={tiny['model']!r} has neither a pad nor an eos token: no rollout can stop, "
        "each runs to sampling.max_new_tokens=5; set eos_token in its tokenizer_config.json"]


def test_settings_that_cannot_mean_anything_are_one_line_errors(tiny, tmp_path):
    cfg = trainer_config(tiny, str(tmp_path), ["algo.filter_groups.enable=true", "sampling.n=1",
                                               "algo.advantage.kind=reinforce_plus_plus", "actor.micro_batch_size=2"])
    with pytest.raises(ConfigError, match=r"^algo\.filter_groups\.enable=true keeps only groups whose rewards differ, "
                                          r"but sampling\.n=1 makes every group a single sample: no group is ever "
                                          r"kept; set sampling\.n >= 2 or algo\.filter_groups\.enable=false$"):
        preflight(cfg, world_size=1)
    cfg = trainer_config(tiny, str(tmp_path), ["algo.overlong_buffer.len=6"])
    with pytest.raises(ConfigError, match=r"^algo\.overlong_buffer\.len=6 > sampling\.max_new_tokens=5: the penalty "
                                          r"would start before the first token and hit every response; set "
                                          r"algo\.overlong_buffer\.len <= 5$"):
        preflight(cfg, world_size=1)
    preflight(trainer_config(tiny, str(tmp_path), ["algo.overlong_buffer.len=5"]), world_size=1)
    gdpo = ["algo.advantage.kind=gdpo", "algo.advantage.gdpo_reward_keys=[a, b]"]
    preflight(trainer_config(tiny, str(tmp_path), gdpo), world_size=1)
    cfg = trainer_config(tiny, str(tmp_path), gdpo + ["algo.overlong_buffer.len=2"])
    with pytest.raises(ConfigError, match=r"^algo\.advantage\.kind=gdpo reads the named reward components of a rule "
                                          r"reward \(reward\.function / by_source returning a dict\), which "
                                          r"algo\.overlong_buffer\.len=2 \(its penalty shapes only the score\) does "
                                          r"not feed; drop it or choose another estimator$"):
        preflight(cfg, world_size=1)
    cfg = trainer_config(tiny, str(tmp_path), ["model.moe.aux_loss_coeff=0.01", "model.moe.token_dispatcher=alltoall"])
    with pytest.raises(ConfigError, match=rf"^model\.moe\.aux_loss_coeff=0\.01, model\.moe\.token_dispatcher="
                                          rf"'alltoall' configure MoE routing, but model\.path={tiny['model']} is a "
                                          r"dense model \(no experts\): they would do nothing; unset them$"):
        preflight(cfg, world_size=1)
    # async off in an async recipe (an A/B run) is legitimate: one warning line, not an error
    cfg = trainer_config(tiny, str(tmp_path), ["trainer.max_staleness=2"])
    preflight(cfg, world_size=1)
    tokenizer = load_tokenizer(tiny["model"])
    assert input_warnings(cfg, tokenizer, load_prompts([tiny["train"]], tokenizer, cfg.data), None) == [
        "trainer.max_staleness=2 has no effect with trainer.async_mode=off (every batch is generated by the current "
        "policy); it applies with trainer.async_mode=one_step_off"]


def test_a_taken_prometheus_port_fails_a_resume_before_anything_is_written(tiny, tmp_path):
    """It used to fail after the resume had rewritten the run's config.yaml (and a fresh run's folder existed)."""
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("the run's own config\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tiny['model']}}}\ndata: {{train_files: [{tiny['train']}], prompts_per_step: 4}}\n"
                   f"run: {{output_dir: {tmp_path / 'runs'}, name: r}}\ndist: {{backend: gloo}}\n"
                   "sampling: {n: 4, max_new_tokens: 5}\nrollout: {native: {max_batch_size: 16, max_seq_len: 32}}\n"
                   "reward: {by_source: {'reasoning_gym/*': reasoning_gym_exact}}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "rlhf", "train", "--config", str(cfg),
                              f"metrics.prometheus_port={port}"], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 2, out.stderr[-2000:]
    assert re.fullmatch(rf"rlhf train: error: metrics\.prometheus_port={port}: cannot listen on 127\.0\.0\.1:{port} "
                        r"\(.+\); choose a free port or -1, or another metrics\.prometheus_host",
                        out.stderr.strip().splitlines()[-1]), out.stderr[-2000:]
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]
    assert (run / "config.yaml").read_text() == "the run's own config\n"
    # profile / bench / doctor on that config serve no endpoint, so a training run holding the port stops none of them
    from rlhf.cli.common import diagnostic_config

    training = trainer_config(tiny, str(tmp_path), [f"metrics.prometheus_port={port}"])
    assert diagnostic_config(training, "profile").metrics.prometheus_port == 0
