"""Rollout dumps: each step's global batch as `rollouts/step_<N>.parquet` in the run folder
(`trainer.dump_rollouts`), and read back as `RolloutBatch`es by `rlhf replay`.

One row per rollout: prompt and response ids and text, the rollout's token logprobs, the sequence score, the
advantages, each token's policy version and staleness (versions behind the actor at step N, N - 1), data_source,
uid (the prompt's dataset index; -1 and data_source "" on a padding row) and group; where responses have interior zeros (multi-turn: tool output and
template tokens) the loss mask (1 on the tokens the policy sampled); with the multi-turn `fork` history each row's
trajectory in its group (a forked trajectory's rows share it); with `multiturn.credit=turn` each token's turn
return-to-go. The step's batch is already gathered on every rank that trains
(`gather_global_batch`), so one of them (rank 0; async: the first training rank) writes it, no collective.
Plain parquet columns only (never pickle); the file's metadata holds the format name, the pad token and the
response width.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlhf.data.records import PromptRecord
from rlhf.errors import ConfigError
from rlhf.run_dir import check_inside
from rlhf.stages.batch import PADDING_UID, RolloutBatch, ScoredBatch
from rlhf.orchestration.dump_schema import FIX, FORMAT, check_footer, check_rows, check_score



def dump_path(folder: Path, step: int) -> Path:
    return folder / f"step_{step:06d}.parquet"


def _rows(values_bt: torch.Tensor, lengths_b: torch.Tensor, start_b: torch.Tensor | None = None) -> list[list]:
    starts = start_b.tolist() if start_b is not None else [0] * len(lengths_b)
    return [values_bt[row, start:start + length].tolist()
            for row, (start, length) in enumerate(zip(starts, lengths_b.tolist()))]


def _length_mask(lengths_b: torch.Tensor, width: int) -> torch.Tensor:
    """bool [B, width]: the first `lengths_b` tokens of each response."""
    return torch.arange(width)[None, :] < lengths_b[:, None]


def batch_table(batch: ScoredBatch, step: int, records: dict[int, PromptRecord], tokenizer: Any):
    """The batch as a pyarrow table (one row per rollout) with the dump's metadata."""
    import pyarrow as pa

    prompt_ids = _rows(batch.tokens_bs, batch.prompt_lengths_b)
    response_ids = _rows(batch.tokens_bs, batch.response_lengths_b, batch.prompt_lengths_b)
    uids = batch.sample_index_b.tolist()
    columns = {
        "step": pa.array([step] * batch.size, pa.int64()),
        # per response token: a partial rollout's row holds tokens of two policy versions
        "policy_version": pa.array(_rows(batch.policy_version_bt, batch.response_lengths_b), pa.list_(pa.int64())),
        # updates the sampling policy is behind the actor that trains on the token (async: > 0)
        "staleness": pa.array(_rows(step - 1 - batch.policy_version_bt, batch.response_lengths_b),
                              pa.list_(pa.int64())),
        "uid": pa.array(uids, pa.int64()),
        "group": pa.array(batch.group_index_b.tolist(), pa.int64()),
        "data_source": pa.array(["" if uid == PADDING_UID else records[uid].data_source for uid in uids],
                                pa.string()),
        "prompt": pa.array([tokenizer.decode(ids, skip_special_tokens=False) for ids in prompt_ids], pa.string()),
        "response": pa.array([tokenizer.decode(ids, skip_special_tokens=True) for ids in response_ids],
                             pa.string()),
        "prompt_ids": pa.array(prompt_ids, pa.list_(pa.int64())),
        "response_ids": pa.array(response_ids, pa.list_(pa.int64())),
        "score": pa.array(batch.scores_b.tolist(), pa.float32()),
        "truncated": pa.array(batch.truncated_b.tolist(), pa.bool_()),
    }
    if not torch.equal(batch.response_mask_bt, _length_mask(batch.response_lengths_b, batch.response_width)):
        # interior zeros (multi-turn); without them the lengths say it all (single-turn dumps stay as they were)
        columns["loss_mask"] = pa.array(_rows(batch.response_mask_bt, batch.response_lengths_b), pa.list_(pa.bool_()))
    if batch.trajectory_index_b is not None:
        columns["trajectory"] = pa.array(batch.trajectory_index_b.tolist(), pa.int64())
    if batch.turn_returns_bt is not None:
        columns["turn_returns"] = pa.array(_rows(batch.turn_returns_bt, batch.response_lengths_b),
                                           pa.list_(pa.float32()))
    for name, field in (("rollout_logprobs", "rollout_logprobs_bt"), ("old_logprobs", "old_logprobs_bt"),
                        ("ref_logprobs", "ref_logprobs_bt"), ("values", "values_bt"), ("advantages", "advantages_bt")):
        values_bt = getattr(batch, field)
        if values_bt is not None:
            columns[name] = pa.array(_rows(values_bt.float(), batch.response_lengths_b), pa.list_(pa.float32()))
    meta = {"format": FORMAT, "pad_token_id": batch.pad_token_id, "response_width": batch.response_width}
    return pa.table(columns).replace_schema_metadata({"rlhf": json.dumps(meta)})


class RolloutDumper:
    """Writes the steps due (`every`) on rank 0, each file atomically (temp file + rename). The first write
    removes dumps from that step on: they belong to an earlier attempt past the step this run resumed from.
    `folder` (inside the run folder) must not be a symlink out of it (ConfigError on every rank)."""

    def __init__(self, folder: Path, *, every: int, records: Sequence[PromptRecord], tokenizer: Any,
                 enabled: bool) -> None:
        check_inside(folder, folder.parent, "trainer.dump_rollouts folder")
        self.folder, self.every, self.enabled, self.tokenizer = folder, every, enabled, tokenizer
        self.records = {record.index: record for record in records}
        self._first = True

    def write(self, batch: ScoredBatch, step: int) -> None:
        if not self.enabled or step % self.every:
            return
        import pyarrow.parquet as pq

        self.folder.mkdir(parents=True, exist_ok=True)
        if self._first:
            for stale in self.folder.glob("step_*.parquet"):
                if stale.stem.removeprefix("step_").isdigit() and int(stale.stem.removeprefix("step_")) >= step:
                    stale.unlink()
            self._first = False
        path = dump_path(self.folder, step)
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)  # a symlink planted there would be written through
        pq.write_table(batch_table(batch, step, self.records, self.tokenizer), tmp)
        os.replace(tmp, path)


def _dump_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise ConfigError(f"--rollouts {folder}: no such folder; {FIX}")
    files = sorted(folder.glob("step_*.parquet"))
    if not files:
        inside = folder / "rollouts"
        fix = f"did you mean --rollouts {inside}?" if inside.is_dir() else FIX
        raise ConfigError(f"--rollouts {folder} holds no step_<N>.parquet dumps; {fix}")
    return files


def _open(path: Path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises several unrelated types for a bad file
        raise ConfigError(f"rollout dump {path} is not a readable parquet file ({type(error).__name__}); "
                          f"{FIX}") from None


def check_dumps(folder: str | Path, *, num_steps: int, rows_per_step: int) -> list[Path]:
    """The dumps replay step 1..num_steps trains on (the folder's files in step order), checked from their
    footers: format, metadata, column types and row count; every problem is a one-line ConfigError naming the
    file."""
    files = _dump_files(Path(folder))
    if len(files) < num_steps:
        raise ConfigError(f"--rollouts {folder} holds {len(files)} step dump(s) but trainer.total_steps={num_steps}; "
                          f"set trainer.total_steps<={len(files)}")
    for path in files[:num_steps]:
        parquet = _open(path)
        check_footer(path, parquet.schema_arrow)
        rows = parquet.metadata.num_rows
        forked = "trajectory" in parquet.schema_arrow.names  # forked trajectories: whole multiples of the step
        if not (rows > 0 and rows % rows_per_step == 0 if forked else rows == rows_per_step):
            raise ConfigError(f"rollout dump {path} has {rows} rollouts, but data.prompts_per_step x sampling.n = "
                              f"{rows_per_step}{' (or a multiple: forked trajectories)' if forked else ''}; replay "
                              "with the config of the run that wrote it")
    return files[:num_steps]


def _padded(rows: list[list], width: int, dtype: torch.dtype, value: float = 0) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=dtype)
    for row, values in enumerate(rows):
        out[row, :len(values)] = torch.tensor(values, dtype=dtype)
    return out


def read_dump(path: Path, vocab_size: int, max_positions: int) -> RolloutBatch:
    """A dump as the RolloutBatch its step trained on (scores and rollout logprobs; the rest is recomputed), every
    row checked against the model first (`dump_schema.check_rows`)."""
    parquet = _open(path)
    meta = check_footer(path, parquet.schema_arrow)
    table = parquet.read().to_pydict()
    check_rows(path, table, meta, vocab_size=vocab_size, max_positions=max_positions)
    prompt_ids, response_ids = table["prompt_ids"], table["response_ids"]
    sequences = [p + r for p, r in zip(prompt_ids, response_ids)]
    lengths_b = torch.tensor([len(r) for r in response_ids], dtype=torch.long)
    width = max(int(meta["response_width"]), int(lengths_b.max()) if len(lengths_b) else 1)
    mask_bt = (_padded(table["loss_mask"], width, torch.bool) if "loss_mask" in table  # absent: no interior zeros
               else _length_mask(lengths_b, width))
    trajectory_b = torch.tensor(table["trajectory"], dtype=torch.long) if "trajectory" in table else None
    turn_returns_bt = _padded(table["turn_returns"], width, torch.float32) if "turn_returns" in table else None
    pad = int(meta["pad_token_id"])
    return RolloutBatch(
        tokens_bs=_padded(sequences, max(2, max(map(len, sequences))), torch.long, pad),
        prompt_lengths_b=torch.tensor([len(p) for p in prompt_ids], dtype=torch.long),
        response_lengths_b=lengths_b, response_mask_bt=mask_bt, loss_mask_bt=mask_bt,
        group_index_b=torch.tensor(table["group"], dtype=torch.long),
        rollout_logprobs_bt=_padded(table["rollout_logprobs"], width, torch.float32),
        truncated_b=torch.tensor(table["truncated"], dtype=torch.bool),
        scores_b=torch.tensor(table["score"], dtype=torch.float32),
        sample_index_b=torch.tensor(table["uid"], dtype=torch.long), trajectory_index_b=trajectory_b,
        policy_version_bt=_padded(table["policy_version"], width, torch.int32),
        baseline_scores_b=None, reward_components_bk=None, routed_experts_bslk=None, pad_token_id=pad,
        turn_returns_bt=turn_returns_bt)


def longest_dumped_row(files: Sequence[Path]) -> tuple[int, str]:
    """(tokens, where) of the longest row (prompt + response) in `files`, from the two id columns alone."""
    import pyarrow.compute as pc

    longest, where = 0, ""
    for path in files:
        table = _open(path).read(columns=["prompt_ids", "response_ids"])
        if not table.num_rows:
            continue
        lengths = pc.add(pc.list_value_length(table["prompt_ids"]), pc.list_value_length(table["response_ids"]))
        tokens = pc.max(lengths).as_py() or 0
        if tokens > longest:
            longest, where = tokens, f"a row of the rollout dump {path}"
    return longest, where


def read_scores(path: Path) -> torch.Tensor:
    """The dump's rollouts' sequence scores (float32, padding rows left out) alone, each checked
    (`dump_schema.check_score`)."""
    parquet = _open(path)
    check_footer(path, parquet.schema_arrow)
    table = parquet.read(columns=["score", "uid"]).to_pydict()
    for row, score in enumerate(table["score"]):
        check_score(path, row, score)
    return torch.tensor([score for score, uid in zip(table["score"], table["uid"]) if uid != PADDING_UID],
                        dtype=torch.float32)
