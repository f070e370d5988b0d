"""Crafted checkpoints whose checksums match (the file rewritten and its manifest entry re-signed) are refused on
load with one line naming the tensor or the field, and `resume: auto` falls back past them as past a checksum
failure: an I32 tensor over a weight's bytes, a NaN weight, a negative Adam second moment; a manifest nested 10^5
deep, holding a 5000-digit int, of the wrong types or with a negative or mismatched step; a state tree that
breaks its schema; a tensor whose shape does not fit the model, or that the checkpoint lacks."""

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from safetensors.torch import save as save_tensors

from rlhf.checkpoint import MANIFEST, CheckpointManager, CorruptCheckpointError, find_latest
from rlhf.checkpoint.state_file import COUNT, STATE_KEY, decode_state, encode_state, tree_problem
from rlhf.errors import CheckpointError
from rlhf.testing.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
from fixtures import make_tiny_setup  # noqa: E402

WEIGHTS = "actor_model_r0.safetensors"
SQUARES = "actor_exp_avg_sq_r0.safetensors"


def _resign(step: Path, name: str) -> None:
    from rlhf.checkpoint.verify import file_entry

    manifest = json.loads((step / MANIFEST).read_text())
    manifest["files"][name] = file_entry((step / name).read_bytes())
    (step / MANIFEST).write_text(json.dumps(manifest))


def _save_two(root: Path) -> CheckpointManager:
    manager = CheckpointManager(root, keep_last=3)
    for step in (1, 2):
        tensors = {"model": {"w": torch.full((4, 3), float(step))}, "exp_avg": {"w": torch.zeros(4, 3)},
                   "exp_avg_sq": {"w": torch.full((4, 3), 0.5)}}
        manager.save(step, {"step": step}, tensors={"actor": tensors})
    return manager


def _as_i32(path: Path) -> None:
    data = path.read_bytes()
    assert data.count(b'"F32"') == 1
    path.write_bytes(data.replace(b'"F32"', b'"I32"'))  # the same bytes, read as integers (~1e9)


def _rewrite(path: Path, value: float) -> None:
    tensors = load_file(path)
    tensors["w"][1, 2] = value
    save_file(tensors, path, metadata={"format": "pt"})


TENSOR_ATTACKS = {
    "i32": (WEIGHTS, _as_i32, "tensor 'w' is I32, but a model tensor is F32 or BF16 or F16"),
    "nan": (WEIGHTS, lambda p: _rewrite(p, float("nan")), "tensor 'w' (model) holds NaN or inf"),
    "negative_moment": (SQUARES, lambda p: _rewrite(p, -1e-3),
                        "tensor 'w' holds negative Adam second moments (exp_avg_sq is never < 0)"),
}


def _skips(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint: skipping")]


@pytest.mark.parametrize("attack", sorted(TENSOR_ATTACKS))
def test_a_tensor_with_a_matching_checksum_is_still_checked(attack, tmp_path, caplog):
    manager = _save_two(tmp_path)
    name, craft, message = TENSOR_ATTACKS[attack]
    step = tmp_path / "step_2"
    craft(step / name)
    _resign(step, name)
    with pytest.raises(CorruptCheckpointError) as error:
        manager.load_for_resume(str(step))
    assert str(error.value) == f"{step}/{name}: {message}"
    with caplog.at_level(logging.WARNING, logger="rlhf.checkpoint"):
        path, state, _ = manager.load_for_resume("auto")
    assert (path.name, state["step"]) == ("step_1", 1)
    assert _skips(caplog) == [f"checkpoint: skipping step_2: {step}/{name}: {message}"]


def _huge(manifest: dict) -> str:
    return json.dumps(manifest).replace('"step": 2', '"step": ' + "9" * 5000)  # past int max str digits


MANIFEST_ATTACKS = {
    "deep": (lambda m: json.dumps(m)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
             "is unreadable (RecursionError: maximum recursion depth exceeded"),
    "5000_digits": (_huge, "is unreadable (ValueError: Exceeds the limit (4300 digits) for integer string conversion"),
    "negative_step": (lambda m: json.dumps({**m, "step": -3}),
                      "has step=-3, but its folder is step_2 (a step is an integer >= 1)"),
    "other_step": (lambda m: json.dumps({**m, "step": 7}),
                   "has step=7, but its folder is step_2 (a step is an integer >= 1)"),
    "bool_step": (lambda m: json.dumps({**m, "step": True}),
                  "has step=True, but its folder is step_2 (a step is an integer >= 1)"),
    "string_world": (lambda m: json.dumps({**m, "world_size": "1"}), "has world_size=1 (an integer >= 1)"),
    "list_files": (lambda m: json.dumps({**m, "files": []}), "has no files table"),
    "size_type": (lambda m: json.dumps({**m, "files": {**m["files"], "rank0.safetensors": {"size": "9", "sha256": 0}}}),
                  "has a malformed entry for 'rank0.safetensors' (needs an integer size >= 0 and a sha256 hex digest)"),
    "outside": (lambda m: json.dumps({**m, "files": {**m["files"], "../x": m["files"]["rank0.safetensors"]}}),
                "lists a file '../x' outside its folder"),
    "tensor_index": (lambda m: json.dumps({**m, "tensors": {"actor": {"model": {"w": "other.safetensors"}}}}),
                     "indexes actor model tensors in 'other.safetensors', a file it does not list"),
    "not_an_object": (lambda m: json.dumps([m]), "is not an rlhf-checkpoint/3 manifest"),
}


@pytest.mark.parametrize("attack", sorted(MANIFEST_ATTACKS))
def test_a_malformed_manifest_is_one_line_and_auto_falls_back(attack, tmp_path, caplog):
    manager = _save_two(tmp_path)
    step = tmp_path / "step_2"
    craft, message = MANIFEST_ATTACKS[attack]
    (step / MANIFEST).write_text(craft(json.loads((step / MANIFEST).read_text())))
    with pytest.raises(CorruptCheckpointError) as error:
        manager.load_for_resume(str(step))
    assert str(error.value).startswith(f"{step}/{MANIFEST} {message}") and "\n" not in str(error.value)
    with caplog.at_level(logging.WARNING, logger="rlhf.checkpoint"):
        path, state, _ = manager.load_for_resume("auto")
    assert (path.name, state["step"]) == ("step_1", 1)
    assert _skips(caplog) == [f"checkpoint: skipping step_2: {error.value}"]
    assert find_latest(tmp_path).name == "step_1"  # export's pick: the manifest is not complete


def test_a_state_tree_is_checked_against_its_schema(tmp_path, caplog):
    manager = _save_two(tmp_path)
    nested = '{"list": [' * 5000 + "]}" * 5000  # a state tree 5000 lists deep: RecursionError when decoded
    deep = save_tensors({}, metadata={STATE_KEY: nested})
    with pytest.raises(CheckpointError, match=r"^x is not an rlhf state file .*: RecursionError: maximum recursion"):
        decode_state(deep, "x")
    (tmp_path / "step_2" / "rank0.safetensors").write_bytes(encode_state({"step": "2"}))
    _resign(tmp_path / "step_2", "rank0.safetensors")

    def check(path, state, manifest):
        return tree_problem(state, {"step": COUNT}, "state")

    with pytest.raises(CorruptCheckpointError, match=r"^state\.step is '2', expected count$"):
        manager.load_for_resume(str(tmp_path / "step_2"), check=check)
    with caplog.at_level(logging.WARNING, logger="rlhf.checkpoint"):
        assert manager.load_for_resume("auto", check=check)[0].name == "step_1"
    assert _skips(caplog) == ["checkpoint: skipping step_2: state.step is '2', expected count"]
    schema = {"kl": {"value": float}, "rng": {"python": tuple}, "n": COUNT}
    assert tree_problem({"kl": {"value": 1}, "rng": {"python": (1,)}, "n": 0}, schema, "state") is None
    assert tree_problem({"kl": {}, "rng": {}, "n": 0}, schema, "state") == "state.kl.value is missing"
    assert tree_problem({"kl": {"value": 1.0}, "rng": [], "n": 0}, schema, "state") == "state.rng is list, expected a dict"
    assert tree_problem({"kl": {"value": 1.0}, "rng": {"python": (1,)}, "n": -3}, schema, "state") == (
        "state.n is '-3', expected count")


def _problems(model_path: str, root: str) -> list:
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import HfFolder
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.checkpoint.verify import checkpoint_problem

    model = build_gpt(AutoConfig.from_pretrained(model_path), build_layout_groups(ParallelLayout()))
    weights = load_file(Path(model_path) / "model.safetensors")
    files = {}
    for kind in ("model", "exp_avg", "exp_avg_sq"):
        tensors = dict(weights)
        if kind == "exp_avg_sq":
            tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].flatten()
        save_file(tensors, f"{root}/{kind}.safetensors")
        files[kind] = {name: f"{kind}.safetensors" for name in tensors}

    def folder_of(kind):
        return HfFolder.of_files(root, files[kind])

    whole = checkpoint_problem(model, folder_of)
    del files["exp_avg_sq"]["model.layers.0.mlp.up_proj.weight"]
    return [whole, checkpoint_problem(model, folder_of)]


def test_checkpoint_tensors_are_checked_against_the_model(tmp_path):
    paths = make_tiny_setup(tmp_path, num_train=8, num_val=4)
    wrong_shape, missing = run_distributed(_problems, 1, paths["model"], str(tmp_path), timeout_s=300)[0]
    assert wrong_shape == (f"tensor 'model.layers.0.mlp.up_proj.weight' in {tmp_path} has shape [2048], config "
                           "expects [64, 32] (exp_avg_sq tensors)")
    assert missing == (f"{tmp_path} is missing tensor 'model.layers.0.mlp.up_proj.weight' (config expects shape "
                       "[64, 32]) (exp_avg_sq tensors)")
