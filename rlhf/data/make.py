"""Make verl-schema prompt datasets offline from reasoning-gym tasks.

reasoning-gym builds item i from `seed + i`, so two sets made with nearby seeds share items. A held-out set
should use a far-away seed and `exclude` the training files: its items are then unique and absent from them.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from rlhf.data.records import SUFFIXES, PromptRecord, read_records, write_records
from rlhf.errors import ConfigError, DataError

PROMPT_FORMATS = ("chat", "text", "expression")
TUPLE_TAG, FRACTION_TAG = "__tuple__", "__fraction__"
ATTEMPTS_PER_ITEM = 20  # with exclusions, give up after this many candidates per wanted item
# reasoning-gym tasks `make` does not offer: no reference answer (the scorer reads the metadata), or no items of
# their own (composite mixes other tasks)
UNOFFERED_TASKS = {"boxnet": "no reference answers", "graph_color": "no reference answers",
                   "propositional_logic": "no reference answers", "rubiks_cube": "no reference answers",
                   "rush_hour": "no reference answers", "composite": "a mix of other tasks, not a task"}


def offered_tasks() -> list[str]:
    """The reasoning-gym tasks `rlhf data make` writes (each round-trips through the file and its scorer)."""
    from reasoning_gym.factory import DATASETS

    return sorted(set(DATASETS) - set(UNOFFERED_TASKS))


@dataclass(kw_only=True)
class MakeConfig:
    """One dataset: `num_samples` items of reasoning-gym `task` (configured by `task_config`) from `seed`."""

    task: str
    num_samples: int
    seed: int = 0
    prompt_format: str = "chat"
    task_config: dict[str, Any] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ConfigError(f"--num-prompts {self.num_samples}: the number of prompts must be >= 1")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ConfigError(f"prompt format {self.prompt_format!r} is not one of {', '.join(PROMPT_FORMATS)}")
        reserved = sorted({"seed", "size"} & set(self.task_config))
        if reserved:
            raise ConfigError(f"task option(s) {', '.join(reserved)} are set by --seed and --n, not as task options")


def _create_task(config: MakeConfig, size: int) -> Any:
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if config.task in UNOFFERED_TASKS:
        raise ConfigError(f"reasoning-gym task {config.task!r} is not offered ({UNOFFERED_TASKS[config.task]}); "
                          "`rlhf data tasks` lists the tasks that are")
    if config.task not in DATASETS:
        close = difflib.get_close_matches(config.task, offered_tasks(), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "`rlhf data tasks` lists them"
        raise ConfigError(f"unknown reasoning-gym task {config.task!r}; {hint}")
    try:
        return reasoning_gym.create_dataset(config.task, **config.task_config, seed=config.seed, size=size)
    except (TypeError, ValueError, AssertionError) as error:
        raise ConfigError(f"bad options {config.task_config} for task {config.task!r}: "
                          f"{type(error).__name__}: {error}") from None


def _prompt(item: dict[str, Any], config: MakeConfig) -> str | list[dict[str, str]]:
    if config.prompt_format == "chat":
        return [{"role": "user", "content": item["question"]}]
    if config.prompt_format == "text":
        return item["question"]
    expression = item["metadata"].get("expression")
    if not isinstance(expression, str):
        raise ConfigError(f"prompt format 'expression' needs items with metadata['expression'] (e.g. chain_sum, "
                          f"basic_arithmetic); task {config.task!r} has none")
    return expression.replace(" ", "") + "="


def _tagged(value: Any) -> Any:
    """Metadata as JSON-native values; tuples and fractions tagged so the scorer gets them back as they were
    (rearc compares tuple grids, gsm_symbolic holds `Fraction`s); sets and numpy values become lists/scalars."""
    if isinstance(value, dict):
        return {key: _tagged(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return {TUPLE_TAG: [_tagged(item) for item in value]}
    if isinstance(value, list):
        return [_tagged(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_tagged(item) for item in value), key=repr)
    if isinstance(value, Fraction):
        return {FRACTION_TAG: str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return _tagged(value.tolist())
    return str(value)


def _untagged(obj: dict) -> Any:
    if len(obj) == 1 and TUPLE_TAG in obj:
        return tuple(obj[TUPLE_TAG])
    if len(obj) == 1 and FRACTION_TAG in obj:
        return Fraction(obj[FRACTION_TAG])
    return obj


def encode_metadata(metadata: dict[str, Any]) -> str:
    """A task item's metadata as the JSON string `extra_info.metadata` holds."""
    return json.dumps(_tagged(metadata), sort_keys=True)


def decode_metadata(text: str) -> dict[str, Any]:
    """`encode_metadata`'s inverse (also reads untagged metadata written before tags existed)."""
    return json.loads(text, object_hook=_untagged)


def _record(item: dict[str, Any], item_index: int, position: int, config: MakeConfig) -> PromptRecord:
    if not isinstance(item.get("answer"), str):
        raise ConfigError(f"task {config.task!r} has no reference answers (its scorer checks answers against the "
                          "metadata), which rule rewards need; pick another task")
    extra_info = {
        "index": position, "task": config.task, "seed": config.seed, "item_index": item_index,
        "question": item["question"], "metadata": encode_metadata(item["metadata"]),
        "task_config": json.dumps(config.task_config, sort_keys=True),
    }
    return PromptRecord(prompt=_prompt(item, config), data_source=f"reasoning_gym/{config.task}",
                        ground_truth=item["answer"], extra_info=extra_info, index=position)


def question_key(record: PromptRecord) -> str:
    """What makes two prompts the same problem: the task's question when known, else the prompt itself."""
    question = record.extra_info.get("question")
    return question if isinstance(question, str) else json.dumps(record.prompt, sort_keys=True)


def make_records(config: MakeConfig) -> list[PromptRecord]:
    """Generate the records; with `exclude`, keep only new, distinct questions (DataError if too few exist)."""
    excluded = {question_key(r) for path in config.exclude for r in read_records(path, require_ground_truth=False)}
    unique = bool(config.exclude)
    limit = config.num_samples * ATTEMPTS_PER_ITEM if unique else config.num_samples
    task = _create_task(config, limit)
    records: list[PromptRecord] = []
    seen = set(excluded)
    for item_index in range(limit):
        record = _record(task[item_index], item_index, len(records), config)
        if unique:
            key = question_key(record)
            if key in seen:
                continue
            seen.add(key)
        records.append(record)
        if len(records) == config.num_samples:
            return records
    raise DataError(f"only {len(records)} of {config.num_samples} {config.task!r} prompts are distinct and absent "
                    f"from {', '.join(config.exclude)} after {limit} tries; widen the task options or ask for fewer")


def make_dataset(config: MakeConfig, out: str | os.PathLike) -> list[PromptRecord]:
    """Generate and write the dataset atomically to `out` (`.jsonl` or `.parquet`); nothing is written on error."""
    if os.path.splitext(out)[1] not in SUFFIXES:
        raise ConfigError(f"--out {str(out)!r} must end in one of {', '.join(SUFFIXES)}")
    records = make_records(config)
    write_records(out, records)
    return records


def parse_task_options(options: Sequence[str]) -> dict[str, Any]:
    """`key=value` pairs to task options; values are JSON when they parse (`3`, `true`, `[1,2]`), else strings."""
    parsed: dict[str, Any] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"task option {option!r} must be written key=value, e.g. max_terms=3")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed
