"""Rollout dumps without a world: a batch written and read back is the batch it trained on; every bad dump
folder is a one-line ConfigError naming the file and the fix."""

import dataclasses
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import scored_batch  # noqa: E402

from rlhf.data.char_tokenizer import build_char_tokenizer  # noqa: E402
from rlhf.data.records import PromptRecord  # noqa: E402
from rlhf.errors import ConfigError  # noqa: E402
from rlhf.stages.batch import RolloutBatch, pad_to_multiple  # noqa: E402
from rlhf.orchestration.rollout_dump import RolloutDumper, check_dumps, dump_path, read_dump, read_scores  # noqa: E402

VOCAB = 18  # the char tokenizer: 4 special tokens + "0123456789+-= "
POSITIONS = 64  # the model's max_position_embeddings


def _batch(interior_zero=False):
    """Two prompts of different lengths, two responses each (one empty), right-padded as the trainer builds them;
    `interior_zero`: the second response's middle token is not trained on (a multi-turn observation token)."""
    prompts, responses = [[5, 6, 16], [7, 14]], [[8, 3], [9, 10, 11], [3], []]
    rows = [prompts[i // 2] + r for i, r in enumerate(responses)]
    tokens = torch.zeros(4, 6, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(r) for r in responses])
    mask = torch.arange(4)[None, :] < lengths[:, None]  # a response width of 4, wider than the longest
    mask[1, 1] = not interior_zero
    logprobs = -torch.rand(4, 4) * mask
    return scored_batch(tokens_bs=tokens, prompt_lengths_b=torch.tensor([3, 3, 2, 2]), response_lengths_b=lengths,
                        response_mask_bt=mask, group_index_b=torch.tensor([0, 0, 1, 1]), rollout_logprobs_bt=logprobs,
                        truncated_b=torch.tensor([False, True, False, False]),
                        scores_b=torch.tensor([1.0, 0.0, 0.5, -1.0]), advantages_bt=torch.randn(4, 4) * mask,
                        sample_index_b=torch.tensor([7, 7, 2, 2]), policy_version_bt=mask.int() * 3)


def _write(folder, step, batch=None):
    records = [PromptRecord(prompt="x", data_source=f"src{i % 2}", ground_truth="1", index=i) for i in range(8)]
    RolloutDumper(folder, every=1, records=records, tokenizer=build_char_tokenizer(), enabled=True).write(
        batch or _batch(), step)
    return dump_path(folder, step)


def test_a_dump_reads_back_as_the_batch_it_trained_on(tmp_path):
    batch = _batch()
    path = _write(tmp_path, 5, batch)
    back = read_dump(path, VOCAB, POSITIONS)
    for name in ("tokens_bs", "prompt_lengths_b", "response_lengths_b", "response_mask_bt", "group_index_b",
                 "rollout_logprobs_bt", "truncated_b", "scores_b", "sample_index_b", "policy_version_bt"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    assert type(back) is RolloutBatch and torch.equal(back.loss_mask_bt, batch.response_mask_bt), "replay rescores"
    assert "loss_mask" not in pq.read_schema(path).names  # the lengths say it all
    assert torch.equal(read_scores(path), batch.scores_b)
    rows = pq.read_table(path).to_pylist()
    assert [row["data_source"] for row in rows] == ["src1", "src1", "src0", "src0"]
    assert [row["response"] for row in rows] == ["4", "567", "", ""]  # <eos> (3) is skipped in the text
    assert rows[0]["prompt"] == "12=" and rows[0]["advantages"] == batch.advantages_bt[0, :2].tolist()
    assert rows[1]["policy_version"] == [3, 3, 3] and rows[1]["staleness"] == [1, 1, 1]  # step 5 trains with v4
    assert not list(tmp_path.glob("*.tmp"))
    RolloutDumper(tmp_path, every=2, records=[], tokenizer=None, enabled=True).write(batch, 7)  # not due
    RolloutDumper(tmp_path, every=1, records=[], tokenizer=None, enabled=False).write(batch, 8)  # not rank 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000005.parquet"]
    # A run resumed at step 4 replaces what an earlier attempt dumped from step 4 on.
    _write(tmp_path, 9)
    _write(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004.parquet"]
    # multi-turn: the loss mask's interior zeros and the rows' trajectories come back; the padding rows of a
    # forked batch are marked (uid -1, no data_source), not shown under the first prompt's
    multiturn = pad_to_multiple(dataclasses.replace(_batch(interior_zero=True),
                                                    trajectory_index_b=torch.tensor([0, 1, 0, 1])), 3)
    path = _write(tmp_path / "multiturn", 5, multiturn)
    back = read_dump(path, VOCAB, POSITIONS)
    for name in ("response_mask_bt", "loss_mask_bt", "trajectory_index_b", "sample_index_b"):
        assert torch.equal(getattr(back, name), getattr(multiturn, name if name != "loss_mask_bt" else
                                                        "response_mask_bt")), name
    rows = pq.read_table(path).to_pylist()
    assert [(row["uid"], row["data_source"]) for row in rows[3:]] == [(2, "src0"), (-1, ""), (-1, "")]
    assert back.group_index_b.tolist() == [0, 0, 1, 1, 2, 3]  # each padding row a group of its own
    assert torch.equal(read_scores(path), multiturn.scores_b[:4])  # replay's reward_norm folds rollouts only


def test_bad_dump_folders_are_one_line_config_errors(tmp_path):
    fix = "point --rollouts at the rollouts/ folder of a run trained with trainer.dump_rollouts=true"
    cases = []
    cases.append((tmp_path / "missing", f"--rollouts {tmp_path / 'missing'}: no such folder; {fix}"))
    (tmp_path / "empty").mkdir()
    cases.append((tmp_path / "empty", f"--rollouts {tmp_path / 'empty'} holds no step_<N>.parquet dumps; {fix}"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk/step_000001.parquet").write_text("not parquet")
    cases.append((tmp_path / "junk", f"rollout dump {tmp_path / 'junk/step_000001.parquet'} is not a readable "
                                     f"parquet file (ArrowInvalid); {fix}"))
    (tmp_path / "foreign").mkdir()
    pq.write_table(pa.table({"prompt": ["1+1"]}), tmp_path / "foreign/step_000001.parquet")
    cases.append((tmp_path / "foreign", f"rollout dump {tmp_path / 'foreign/step_000001.parquet'} is not an rlhf "
                                        f"rollout dump (format None, expected 'rlhf.rollouts/1'); {fix}"))
    for folder, message in cases:
        with pytest.raises(ConfigError) as error:
            check_dumps(folder, num_steps=1, rows_per_step=4)
        assert str(error.value) == message and "\n" not in message
    good = tmp_path / "run/rollouts"
    _write(good, 1)
    with pytest.raises(ConfigError, match=rf"^--rollouts {tmp_path / 'run'} holds no step_<N>.parquet dumps; did you "
                                          rf"mean --rollouts {good}\?$"):
        check_dumps(tmp_path / "run", num_steps=1, rows_per_step=4)
    with pytest.raises(ConfigError, match=r"^--rollouts .*/rollouts holds 1 step dump\(s\) but trainer.total_steps=2; "
                                          r"set trainer.total_steps<=1$"):
        check_dumps(good, num_steps=2, rows_per_step=4)
    with pytest.raises(ConfigError, match=r"step_000001.parquet has 4 rollouts, but data.prompts_per_step x "
                                          r"sampling.n = 8; replay with the config of the run that wrote it$"):
        check_dumps(good, num_steps=1, rows_per_step=8)
    assert check_dumps(good, num_steps=1, rows_per_step=4) == [dump_path(good, 1)]
    with pytest.raises(ConfigError, match=r"step_000001.parquet row 0 column prompt_ids: token id 16 is outside "
                                          r"model.path's vocabulary of 12; replay with the model \(tokenizer\) the "
                                          r"dump was made with$"):
        read_dump(dump_path(good, 1), 12, POSITIONS)
    table = pq.read_table(dump_path(good, 1))
    pq.write_table(table.drop(["score"]).replace_schema_metadata(table.schema.metadata), good / "step_000002.parquet")
    with pytest.raises(ConfigError, match=r"step_000002.parquet lacks the column\(s\) score; point --rollouts"):
        check_dumps(good, num_steps=2, rows_per_step=4)
    assert json.loads(table.schema.metadata[b"rlhf"]) == {"format": "rlhf.rollouts/1", "pad_token_id": 0,
                                                          "response_width": 4}


def _crafted(folder, name, column, row, value, arrow_type=None):
    """The good dump with one row's `column` set to `value` (the column keeps its type unless `arrow_type`)."""
    table = pq.read_table(_write(folder / "good", 1, _batch(interior_zero=column == "loss_mask")))
    values = table.column(column).to_pylist()
    values[row] = value
    index = table.schema.get_field_index(column)
    field = table.schema.field(index)
    array = pa.array(values, arrow_type or field.type)
    crafted = table.set_column(index, pa.field(column, array.type), array)
    path = folder / name / "step_000001.parquet"
    path.parent.mkdir()
    pq.write_table(crafted.replace_schema_metadata(table.schema.metadata), path)
    return path


@pytest.mark.parametrize("column, value, arrow_type, what", [
    ("response_ids", [9, -3, 11], None, "token id -3 is outside model.path's vocabulary of 18"),
    ("response_ids", [9, None, 11], None, "a null value"),
    ("response_ids", [9, 2 ** 40, 11], None, "token id 1099511627776 is outside model.path's vocabulary of 18"),
    ("prompt_ids", [], None, "an empty prompt"),
    ("policy_version", [3, 2 ** 31, 3], None, "policy version 2147483648 is outside [0, 2147483647]"),
    ("policy_version", [3, 3], None, "2 values for a response of 3 tokens"),
    ("rollout_logprobs", [-0.5, 50.0, -0.1], None, "log-probability 50.0 is not a finite number <= 0"),
    ("rollout_logprobs", [-0.5, float("-inf"), -0.1], None, "log-probability -inf is not a finite number <= 0"),
    ("rollout_logprobs", [-0.5, -1e300, -0.1], pa.list_(pa.float64()),
     "log-probability -1e+300 is not a finite number <= 0"),
    ("score", float("nan"), None, "score nan is not a finite float32"),
    ("score", None, None, "a null value"),
    ("truncated", None, None, "a null value"),
    ("uid", -2, None, "uid -2 is not a dataset index in [0, 9223372036854775807] (or -1: a padding row)"),
    ("loss_mask", [True, True], None, "2 values for a response of 3 tokens"),
    ("loss_mask", [True, None, True], None, "a null value"),
])
def test_a_bad_value_is_one_line_naming_the_file_row_and_column(tmp_path, column, value, arrow_type, what):
    """They were raw tracebacks (torch's int32 overflow, a None in torch.tensor) or trained (+50 log-probs)."""
    path = _crafted(tmp_path, "bad", column, 1, value, arrow_type)
    fix = ("replay with the model (tokenizer) the dump was made with" if "vocabulary" in what else
           "point --rollouts at the rollouts/ folder of a run trained with trainer.dump_rollouts=true")
    with pytest.raises(ConfigError) as error:
        read_dump(path, VOCAB, POSITIONS)
    assert str(error.value) == f"rollout dump {path} row 1 column {column}: {what}; {fix}"
    if column == "score":
        with pytest.raises(ConfigError, match=r"row 1 column score: "):
            read_scores(path)


def test_a_prompt_past_the_models_positions_is_one_line(tmp_path):
    path = _write(tmp_path, 1)
    with pytest.raises(ConfigError) as error:
        read_dump(path, VOCAB, 5)  # row 1: 3 prompt + 3 response tokens
    assert str(error.value) == (f"rollout dump {path} row 1 column response_ids: 3 prompt + 3 response tokens exceed "
                                "model.path's max_position_embeddings=5; replay with the model (tokenizer) the dump "
                                "was made with")


def test_a_bad_footer_is_one_line_before_any_row_is_read(tmp_path):
    fix = "point --rollouts at the rollouts/ folder of a run trained with trainer.dump_rollouts=true"
    table = pq.read_table(_write(tmp_path / "good", 2))
    ids = [[str(i) for i in row] for row in table.column("prompt_ids").to_pylist()]
    strings = tmp_path / "strings" / "step_000001.parquet"
    strings.parent.mkdir()
    index = table.schema.get_field_index("prompt_ids")
    crafted = table.set_column(index, "prompt_ids", pa.array(ids, pa.list_(pa.string())))
    pq.write_table(crafted.replace_schema_metadata(table.schema.metadata), strings)
    with pytest.raises(ConfigError) as error:
        check_dumps(strings.parent, num_steps=1, rows_per_step=4)
    assert str(error.value) == (f"rollout dump {strings} column prompt_ids holds list<element: string>, expected a list "
                                f"of integers per row; {fix}")
    for name, metadata, message in (
            ("not_json", b"{not json", "has 'rlhf' metadata that is not valid JSON"),
            ("huge_int", b'{"format": "rlhf.rollouts/1", "pad_token_id": ' + b"9" * 5000 + b"}",
             "has 'rlhf' metadata that is not valid JSON"),
            ("deep", b"[" * 100_000 + b"]" * 100_000, "has 'rlhf' metadata that is not valid JSON"),
            ("pad", json.dumps({"format": "rlhf.rollouts/1", "pad_token_id": "0", "response_width": 4}).encode(),
             "metadata pad_token_id='0' is not an integer >= 0"),
            ("width", json.dumps({"format": "rlhf.rollouts/1", "pad_token_id": 0, "response_width": -1}).encode(),
             "metadata response_width=-1 is not an integer >= 1")):
        path = tmp_path / name / "step_000001.parquet"
        path.parent.mkdir()
        pq.write_table(table.replace_schema_metadata({"rlhf": metadata}), path)
        with pytest.raises(ConfigError) as error:
            check_dumps(path.parent, num_steps=1, rows_per_step=4)
        assert str(error.value) == f"rollout dump {path} {message}; {fix}"
    wide = tmp_path / "wide" / "step_000001.parquet"
    wide.parent.mkdir()
    meta = {"format": "rlhf.rollouts/1", "pad_token_id": 0, "response_width": 10 ** 12}
    pq.write_table(table.replace_schema_metadata({"rlhf": json.dumps(meta)}), wide)
    with pytest.raises(ConfigError) as error:
        read_dump(wide, VOCAB, POSITIONS)
    assert str(error.value) == (f"rollout dump {wide} metadata response_width=1000000000000 is above 64 (model.path: "
                                "vocabulary 18, max_position_embeddings 64); replay with the model (tokenizer) the dump "
                                "was made with")


def _long_batch(rows, prompt_length, response_lengths):
    """`rows` rollouts of one `prompt_length`-token prompt, the i-th response `response_lengths[i]` tokens."""
    width = max(response_lengths)
    tokens = torch.full((rows, prompt_length + width), 0, dtype=torch.long)
    tokens[:, :prompt_length] = 5
    lengths = torch.tensor(response_lengths)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    for row, length in enumerate(response_lengths):
        tokens[row, prompt_length:prompt_length + length] = 8
    return scored_batch(tokens_bs=tokens, prompt_lengths_b=torch.full((rows,), prompt_length),
                        response_lengths_b=lengths, response_mask_bt=mask, group_index_b=torch.arange(rows) // 4,
                        rollout_logprobs_bt=-0.5 * mask, truncated_b=torch.zeros(rows, dtype=torch.bool),
                        scores_b=torch.zeros(rows), sample_index_b=torch.arange(rows) // 4,
                        policy_version_bt=mask.int())


def test_the_longest_dumped_row_is_found_across_files(tmp_path):
    from rlhf.orchestration.rollout_dump import longest_dumped_row

    first = _write(tmp_path, 1, _long_batch(4, 3, [1, 2, 1, 1]))
    second = _write(tmp_path, 2, _long_batch(4, 3, [1, 1, 4, 2]))
    assert longest_dumped_row([first]) == (5, f"a row of the rollout dump {first}")
    assert longest_dumped_row([first, second]) == (7, f"a row of the rollout dump {second}")


def test_replay_refuses_dumps_longer_than_a_packing_budget_before_anything_starts(tmp_path):
    """Dumps of a run with longer rows than the replay config's limits: `auto` budgets sized from those limits
    would fail in the step that reads the long row; preflight names the budget, the dump and the fix."""
    from fixtures import make_tiny_setup, trainer_config

    from rlhf.orchestration.replay import replay_config, replay_preflight

    paths = make_tiny_setup(tmp_path / "tiny", num_train=16, num_val=2)
    dumps = tmp_path / "dumps"
    path = _write(dumps, 1, _long_batch(16, 16, [4] + [1] * 15))
    overrides = [f"replay.rollouts={dumps}", "trainer.total_steps=1", "data.val_files=[]",
                 "sampling.max_new_tokens=1", "actor.micro_batch_size=1"]  # auto: 1 x (16 + 1) tokens
    cfg = replay_config(trainer_config(paths, str(tmp_path / "runs"), overrides))
    assert cfg.actor.max_tokens_per_microbatch == 17
    with pytest.raises(ConfigError) as error:
        replay_preflight(cfg, 1)
    assert str(error.value) == ("actor.max_tokens_per_microbatch=17 is smaller than the longest row, 20 tokens (a row "
                                f"of the rollout dump {path}); raise actor.max_tokens_per_microbatch to at least 20")
    assert not (tmp_path / "runs").exists()
    fits = replay_config(trainer_config(paths, str(tmp_path / "runs"), overrides + ["sampling.max_new_tokens=4"]))
    replay_preflight(fits, 1)
