"""Input checks `rlhf train` runs before the run folder exists, and the one-line warnings it logs after.

Each failure is one line naming the path or key and the fix: a folder that is not an HF model, a config.json
transformers cannot read, missing tokenizer files, unreadable safetensors, an output folder that cannot be
written, a KV cache too small for the prompts, a resume path that is no checkpoint, a reward model whose
tokenizer ends or pads sequences with other tokens than the policy's.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from rlhf.checkpoint import CheckpointManager
from rlhf.data.tokenize import TokenizedPrompts
from rlhf.errors import ConfigError
from rlhf.models.hf_load import HfFolder, check_folder, folder_head
from rlhf.models.spec import ModelSpec


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def read_hf_config(path: str, label: str = "model.path") -> Any:
    """The folder's HF config, or a ConfigError saying what is wrong with the folder."""
    if not path or not Path(path).is_dir():
        raise ConfigError(f"{label}={path!r} is not a folder; point it at an HF model folder "
                          "(config.json + safetensors), e.g. one written by `rlhf sft`")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{label}={path!r} has no config.json, so it is not an HF model folder; point it at one "
                          "(config.json + safetensors), e.g. one written by `rlhf sft` or `rlhf init-model`")
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"{label}={path!r}: transformers cannot read its config.json ({_first_line(error)}); "
                          "fix the file or re-export the folder") from None


def check_model_folders(cfg: Any) -> None:
    """Every model folder the run loads: a supported architecture, and readable safetensors headers that hold
    the tensors its config implies (no tensor data is read)."""
    folders = [("model.path", cfg.model.path, False)]
    if cfg.algo.uses_critic and cfg.model.critic_path:
        folders.append(("model.critic_path", cfg.model.critic_path, True))
    if cfg.reward.model_path:
        folders.append(("reward.model_path", cfg.reward.model_path, True))
    folders += [(label, path, False) for label, path in teacher_folders(cfg)]
    for label, path, value_head in folders:
        spec = ModelSpec.from_hf(read_hf_config(path, label))  # first: it names the key of a wrong path
        check_folder(HfFolder(path), spec, value_head=value_head)


def teacher_folders(cfg: Any) -> list[tuple[str, str]]:
    """(key, folder) of every distillation teacher, each once (none when algo.distill is off)."""
    distill = cfg.algo.distill
    if not distill.enable:
        return []
    keys = {path: f"algo.distill.routes.{source}" for source, path in reversed(distill.routes.items())}
    if distill.teacher_path:
        keys[distill.teacher_path] = "algo.distill.teacher_path"
    return [(keys[path], path) for path in distill.teacher_paths]


def check_teacher_tokenizers(cfg: Any, tokenizer: Any) -> None:
    """A teacher scores the student's token ids, so its tokenizer must be the student's (same vocabulary and
    special tokens): else every teacher logprob is of another token."""
    student = (tokenizer.get_vocab(), _special_ids(tokenizer))
    for label, path in teacher_folders(cfg):
        teacher = load_tokenizer(path, label)
        if (teacher.get_vocab(), _special_ids(teacher)) != student:
            raise ConfigError(f"{label}={path!r} has another tokenizer than the student (model.path="
                              f"{cfg.model.path!r}): a teacher scores the student's token ids, so distil from a "
                              "teacher with the student's tokenizer")


def check_resume_path(resume: str) -> None:
    """An explicit `checkpoint.resume` folder must be a complete checkpoint (`auto` and `none` are checked later)."""
    if resume not in ("auto", "none"):
        CheckpointManager(Path(resume).parent).resolve(resume)


def load_tokenizer(path: str, label: str = "model.path") -> Any:
    """The folder's tokenizer, or a ConfigError naming the folder and the files it needs."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"{label}={path!r} has no usable tokenizer ({_first_line(error)}); copy the base "
                          "model's tokenizer files (tokenizer.json, tokenizer_config.json) into it") from None


def check_writable_folder(path: str | os.PathLike, label: str) -> None:
    """`path` is (or can be made) a folder this process can write into; probes with an empty temp folder."""
    target = Path(path)
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{label}={str(path)!r}: {existing} is a file, not a folder; choose another {label}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlhf-write-probe-", dir=existing))
    except OSError as error:
        raise ConfigError(f"{label}={str(path)!r}: cannot write in {existing} ({error.strerror}); choose a "
                          f"writable {label}") from None


def check_kv_cache(cfg: Any, longest_prompt: int) -> None:
    """The native engine's KV cache holds the longest prompt + max_new_tokens (multi-turn: a turn generates within
    its row's token budget, which check_multiturn holds to max_seq_len), and n samples of one prompt."""
    if cfg.rollout.engine != "native":
        return
    native, sampling = cfg.rollout.native, cfg.sampling
    needed = longest_prompt + sampling.max_new_tokens
    if needed > native.max_seq_len and not cfg.multiturn.enable:
        raise ConfigError(f"the longest prompt ({longest_prompt} tokens) + sampling.max_new_tokens="
                          f"{sampling.max_new_tokens} needs {needed} KV-cache positions but rollout.native.max_seq_len="
                          f"{native.max_seq_len}; raise rollout.native.max_seq_len or shorten prompts/max_new_tokens")
    for key, n in (("sampling.n", sampling.n), ("sampling.val_n", sampling.val_n)):
        if n > native.max_batch_size:
            raise ConfigError(f"{key}={n} samples of one prompt need {n} KV-cache slots but "
                              f"rollout.native.max_batch_size={native.max_batch_size}; raise it or lower {key}")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _special_ids(tokenizer: Any) -> dict[str, int | None]:
    """The eos id and the pad id rollouts are padded with (the trainer pads with eos when there is no pad)."""
    eos = tokenizer.eos_token_id
    return {"eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos}


def check_reward_tokenizer(cfg: Any, tokenizer: Any) -> None:
    """A reward model reads the policy's token ids and scores the last one (its eos): a reward model folder that
    ships a tokenizer must agree with the policy's on eos and pad, or every score is read at the wrong token."""
    path = cfg.reward.model_path
    if not path or not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        return
    policy, reward = _special_ids(tokenizer), _special_ids(load_tokenizer(path, "reward.model_path"))
    for key, policy_id in policy.items():
        if reward[key] != policy_id:
            raise ConfigError(
                f"reward.model_path={path!r} has {key}={reward[key]} but the policy's tokenizer (model.path="
                f"{cfg.model.path!r}) has {key}={policy_id}: the reward model scores the policy's tokens, so it "
                "must use the same tokenizer; train the reward model from the policy's tokenizer, or, if the "
                "vocabularies are the same, copy model.path's tokenizer files into the reward model folder")


def score_head_warning(cfg: Any) -> str | None:
    """A reward model folder without `score.weight` gets a freshly initialised head: its rewards are noise."""
    path = cfg.reward.model_path
    if not path or folder_head(HfFolder(path), value_head=True) != "none":
        return None
    return (f"reward.model_path={path!r} has no score head (score.weight), so the reward model's head is randomly "
            "initialised and its rewards are noise; point reward.model_path at a trained reward model "
            "(e.g. AutoModelForSequenceClassification with num_labels=1)")


def input_warnings(cfg: Any, tokenizer: Any, train: TokenizedPrompts, val: TokenizedPrompts | None) -> list[str]:
    """Inputs that run but train badly: a tokenizer that cannot end a rollout, prompts that became unknowns,
    a reward model with a random score head, an async setting the synchronous loop ignores."""
    found = [pad_and_eos_warning(tokenizer, cfg), unknown_token_warning(train, tokenizer, "data.train_files"),
             score_head_warning(cfg), staleness_warning(cfg)]
    if val is not None:
        found.append(unknown_token_warning(val, tokenizer, "data.val_files"))
    return [warning for warning in found if warning]


def staleness_warning(cfg: Any) -> str | None:
    """A warning, not an error: switching async off in an async recipe (an A/B run) keeps its max_staleness."""
    if cfg.trainer.is_async or cfg.trainer.max_staleness == 1:
        return None
    return (f"trainer.max_staleness={cfg.trainer.max_staleness} has no effect with trainer.async_mode=off (every "
            "batch is generated by the current policy); it applies with trainer.async_mode=one_step_off")


def pad_and_eos_warning(tokenizer: Any, cfg: Any) -> str | None:
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        return (f"the tokenizer of model.path={cfg.model.path!r} has neither a pad nor an eos token: no rollout can "
                f"stop, each runs to sampling.max_new_tokens={cfg.sampling.max_new_tokens}; set eos_token in its "
                "tokenizer_config.json")
    return None


def unknown_token_warning(prompts: TokenizedPrompts, tokenizer: Any, label: str) -> str | None:
    """One line when prompts hold characters the vocabulary lacks (they became the unknown token)."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return None
    hits = [i for i, ids in enumerate(prompts.token_ids) if unk in ids]
    if not hits:
        return None
    num_unk = sum(prompts.token_ids[i].count(unk) for i in hits)
    first = prompts.records[hits[0]]
    return (f"{len(hits)} of {len(prompts.token_ids)} prompts in {label} hold characters outside the tokenizer's "
            f"vocabulary ({num_unk} tokens became {tokenizer.unk_token!r}; first: record index {first.index}); "
            "check that the tokenizer matches the data")
