"""Reading verl-schema JSONL/parquet into PromptRecords, and the line-numbered errors for bad rows."""

import json

import pytest

from rlhf.data.records import PromptRecord, read_records, write_records
from rlhf.errors import DataError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
ROWS = [
    {"prompt": CHAT, "data_source": "openai/gsm8k", "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"split": "train", "index": 7}},
    {"prompt": "2+2=", "data_source": "reasoning_gym/chain_sum", "reward_model": {"ground_truth": 4}},
]


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_jsonl_reads_chat_and_text_prompts(tmp_path):
    records = read_records(write_jsonl(tmp_path / "d.jsonl", ROWS))
    assert records == [
        PromptRecord(prompt=CHAT, data_source="openai/gsm8k", ground_truth="2",
                     extra_info={"split": "train", "index": 7}, index=0),
        PromptRecord(prompt="2+2=", data_source="reasoning_gym/chain_sum", ground_truth="4", extra_info={}, index=1),
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_write_then_read_round_trips(tmp_path, suffix):
    records = [PromptRecord(prompt=CHAT, data_source="math", ground_truth="\\frac{1}{2}",
                            extra_info={"index": i}, index=i) for i in range(3)]
    records.append(PromptRecord(prompt=CHAT, data_source="math", ground_truth="3", extra_info={}, index=3))
    path = tmp_path / f"d{suffix}"
    write_records(path, records)
    back = read_records(path)
    assert back == records
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x", "data_source": "a"', "d.jsonl:2: invalid JSON"),
    ('["x"]', "d.jsonl:2: expected a JSON object, got list"),
    ('{"data_source": "a", "reward_model": {"ground_truth": "1"}}', "d.jsonl:2: missing 'prompt'"),
    ('{"prompt": "x", "reward_model": {"ground_truth": "1"}}', "d.jsonl:2: 'data_source' must be a non-empty string"),
    ('{"prompt": "x", "data_source": "a"}', "d.jsonl:2: missing reward_model.ground_truth"),
    ('{"prompt": "x", "data_source": "a", "reward_model": {"ground_truth": null}}',
     "d.jsonl:2: missing reward_model.ground_truth"),
    ('{"prompt": [{"role": "user"}], "data_source": "a", "reward_model": {"ground_truth": "1"}}',
     "d.jsonl:2: prompt message 0 must be"),
    ('{"prompt": [], "data_source": "a", "reward_model": {"ground_truth": "1"}}',
     "d.jsonl:2: 'prompt' must be a string or a non-empty list"),
    ('{"prompt": "x", "data_source": "a", "reward_model": {"ground_truth": "1"}, "extra_info": 3}',
     "d.jsonl:2: 'extra_info' must be an object"),
    ('{"prompt": "x", "data_source": "a", "reward_model": {"ground_truth": [1]}}',
     "d.jsonl:2: reward_model.ground_truth must be a string or number"),
])
def test_bad_line_is_named_by_number(tmp_path, line, message):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[1], line, ROWS[0]])
    with pytest.raises(DataError) as info:
        read_records(path)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_ground_truth_optional_when_not_required(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "data_source": "rm"}])
    assert read_records(path, require_ground_truth=False)[0].ground_truth is None


def test_blank_lines_are_skipped_but_counted(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[1], "", '{"prompt": 1, "data_source": "a"}'])
    with pytest.raises(DataError, match=r"d.jsonl:3: 'prompt' must be"):
        read_records(path)


def test_parquet_bad_row_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "x", "data_source": "a", "reward_model": {"ground_truth": "1"}},
            {"prompt": "y", "data_source": "a", "reward_model": {"ground_truth": None}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d.parquet: row 2: missing reward_model.ground_truth"):
        read_records(tmp_path / "d.parquet")


@pytest.mark.parametrize("name, content, message", [
    ("d.csv", "a", "unknown dataset format '.csv'"),
    ("d.parquet", "not parquet", "not a readable parquet file"),
    ("d.jsonl", "\n", "dataset is empty"),
])
def test_bad_files(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=message):
        read_records(tmp_path / name)


def test_encoding(tmp_path):
    row = json.dumps(ROWS[1]).encode()
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + row + b"\r\n" + row + b"\r\n")
    assert len(read_records(tmp_path / "bom.jsonl")) == 2
    (tmp_path / "latin1.jsonl").write_bytes(row + b"\n" + row.replace(b"2+2", b"\xe92+2") + b"\n")
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 13\)"):
        read_records(tmp_path / "latin1.jsonl")


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="dataset file not found"):
        read_records(tmp_path / "none.jsonl")
