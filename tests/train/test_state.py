"""A checkpoint's full tensors are checked against the model before any is loaded: a moment of another shape
(the same bytes reshaped) or a kind the checkpoint lacks is one line naming the tensor, the file and the kind."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from fixtures import make_tiny_setup  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402


def _problems(model_path: str, root: str) -> list:
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import HfFolder
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.train.state import checkpoint_problem

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
