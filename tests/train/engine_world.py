"""Everything the engine tests check, run in ONE 2-rank gloo world (launches are expensive here).

Each `check_*` builds fresh engines on layouts of the shared world (DP2, TP2, PP2 and one single-rank layout
per rank), all loaded from the same HF folder, and returns plain numbers/strings the test module asserts on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tests.train.helpers import hf_sft_loss, nan_grads, poisoned, sft_batch


def _groups() -> dict:
    from rlhf.parallel.groups import GroupCache, build_layout_groups
    from rlhf.parallel.layout import ParallelLayout

    cache, rank = GroupCache(), dist.get_rank()
    groups = {name: build_layout_groups(ParallelLayout(tp=tp, pp=pp, dp=dp), cache)
              for name, (tp, pp, dp) in {"dp2": (1, 1, 2), "tp2": (2, 1, 1), "pp2": (1, 2, 1)}.items()}
    single = [build_layout_groups(ParallelLayout(tp=1, pp=1, dp=1, first_rank=r), cache) for r in range(2)]
    return {**groups, "single": single[rank]}


def _engine(path: str, pgs, *, load: bool = True, seed: int = 1234, name: str = "actor", value_head: bool = False,
            params_dtype: torch.dtype = torch.float32, **optim):
    from transformers import AutoConfig

    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import load_hf_weights
    from rlhf.train.config import OptimConfig
    from rlhf.train.engine import TrainEngine

    model = build_gpt(AutoConfig.from_pretrained(path), pgs, seed=seed, value_head=value_head,
                      params_dtype=params_dtype)
    if load:
        load_hf_weights(model, path)
    optim = {"lr": 1e-2, "total_steps": 20, **optim}
    return TrainEngine(model, pgs, OptimConfig(**optim), name=name)


def _batches(pgs, num_micro_batches: int, seed: int, num_rows: int = 8, seq_len: int = 16) -> list:
    from rlhf.testing.engine_nll import sft_micro_batches

    tokens, mask = sft_batch(num_rows, seq_len, seed)
    return sft_micro_batches(tokens, mask, dp_rank=pgs.dp.rank(), dp_size=pgs.dp.size(),
                             num_micro_batches=num_micro_batches)


def _loss_fn(engine):
    from rlhf.testing.engine_nll import sft_loss

    return sft_loss(engine.pg_collection.tp, engine.module.rlhf_spec.vocab_size)


def _grads(engine) -> dict:
    return {n: p.main_grad.clone() for n, p in engine.module.named_parameters()}


def _weights(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _opt_tensors(engine, clone: bool = True) -> dict:
    out = {}
    for i, part in enumerate(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])):
        for j, state in enumerate(part.optimizer.state.values()):
            out.update({f"{i}.{j}.{k}": v.clone() if clone else v for k, v in state.items()
                        if isinstance(v, torch.Tensor)})
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def check_loss_scaling(path: str, pg: dict) -> dict:
    """Global-count loss: same loss and grads at DP=2 vs DP=1 and at 1 vs 2 micro-batches."""
    results = {}
    weights = {}
    for key, pgs, num_micro_batches, distributed_optimizer in (
            ("dp2_m2", pg["dp2"], 2, False), ("dp1_m1", pg["single"], 1, False), ("dp1_m2", pg["single"], 2, False),
            ("dp2_distopt", pg["dp2"], 2, True)):
        engine = _engine(path, pgs, clip_grad=0.0, use_distributed_optimizer=distributed_optimizer)
        step = engine.train_step(_batches(pgs, num_micro_batches, seed=0), _loss_fn(engine))
        # the distributed optimizer only reduce-scatters: each rank holds its shard of the summed grads
        grads = None if distributed_optimizer else _grads(engine)
        results[key], weights[key] = (step.loss, step.grad_norm, grads), _weights(engine)
    ref_loss, ref_norm, ref_grads = results.pop("dp1_m1")
    out = {key: {"loss_diff": abs(loss - ref_loss), "norm_diff": abs(norm - ref_norm), "loss": loss,
                 "grad_diff": _max_diff(grads, ref_grads) if grads is not None else 0.0}
           for key, (loss, norm, grads) in results.items()}
    out["distopt_weight_diff"] = _max_diff(weights["dp2_distopt"], weights["dp2_m2"])
    return out


def check_layouts(path: str, pg: dict, layouts: tuple[str, ...] = ("tp2", "pp2", "tp2_distopt", "pp2_distopt")) -> dict:
    """Layouts (`<layout>_distopt`: with the distributed optimizer) vs one rank from the same HF weights: 3 SFT
    steps' losses and grad norms; HF's loss."""
    tokens, mask = sft_batch(8, 16, seed=1)
    hf_loss, _ = hf_sft_loss(path, tokens, mask)
    out = {"hf_loss": hf_loss}
    for key in ("single", *layouts):
        name, _, optimizer = key.partition("_")
        engine = _engine(path, pg[name], use_distributed_optimizer=optimizer == "distopt")
        steps = [engine.train_step(_batches(pg[name], 2, seed=1), _loss_fn(engine)) for _ in range(3)]
        out[key] = [(step.loss, step.grad_norm) for step in steps]
    return out


def check_forward_only(path: str, pg: dict) -> dict:
    """Next-token logprobs from `forward_only` at TP2 and PP2 match transformers; PP's first stage gets none."""
    from rlhf.models.forward import token_logprobs

    tokens, mask = sft_batch(4, 16, seed=5)
    _, hf_logprobs = hf_sft_loss(path, tokens, mask)
    out = {}
    for key in ("tp2", "pp2"):
        engine = _engine(path, pg[key])
        vocab = engine.module.rlhf_spec.vocab_size

        def logprobs_fn(logits_bsv, batch, tp_group=engine.pg_collection.tp):
            values = token_logprobs(logits_bsv[:, :-1], batch.tokens_bs[:, 1:], tp_group, vocab)
            return values.sum(), {"logprobs": values}

        batches = _batches(pg[key], 2, seed=5, num_rows=4)
        results = engine.forward_only(batches, logprobs_fn)
        got = torch.cat([r["logprobs"] for r in results]) if results else None
        out[key] = {"count": len(results), "diff": (got - hf_logprobs).abs().max().item() if results else None}
    return out


def check_sft_learns(path: str, pg: dict) -> dict:
    """12 SFT steps at DP2 on one batch: the answer NLL falls well below its start."""
    engine = _engine(path, pg["dp2"], lr=3e-3)
    batches = _batches(pg["dp2"], 1, seed=6)
    from rlhf.testing.engine_nll import sft_step

    return {"losses": [sft_step(engine, batches).loss for _ in range(12)]}


def check_critic(path: str, pg: dict) -> dict:
    """A value-head critic: value-loss steps agree across one rank, TP2 and PP2; forward_only gives values."""
    tokens, mask = sft_batch(8, 16, seed=7)
    returns = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(7))
    count = int(mask.sum())

    def value_loss(values_bs1, batch):
        rows = batch.rows
        error = (values_bs1.squeeze(-1) - returns[rows]) * mask[rows]
        return 0.5 * (error ** 2).sum() / count, {}

    def values_fn(values_bs1, batch):
        return values_bs1.sum(), {"values": values_bs1.squeeze(-1)}

    out = {}
    for key in ("single", "tp2", "pp2"):
        engine = _engine(path, pg[key], name="critic", value_head=True, lr=1e-3)
        batches = [_Rows(tokens_bs=tokens[rows], rows=rows) for rows in (slice(0, 4), slice(4, 8))]
        steps = [engine.train_step(batches, value_loss) for _ in range(3)]
        values = engine.forward_only(batches, values_fn)
        out[key] = {"steps": [(step.loss, step.grad_norm) for step in steps],
                    "values": torch.cat([v["values"] for v in values]).flatten().tolist() if values else None}
    return out


@dataclass
class _Rows:
    tokens_bs: torch.Tensor
    rows: slice


def check_schedule(path: str, pg: dict) -> dict:
    """LR used by each of 8 steps: warmup 2 then cosine to min_lr at step 6, then min_lr."""
    engine = _engine(path, pg["single"], lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_style="cosine",
                     total_steps=6)
    batches = _batches(pg["single"], 1, seed=2, num_rows=2)
    return {"lrs": [engine.train_step(batches, _loss_fn(engine)).lr for _ in range(8)]}


def check_clipping(path: str, pg: dict) -> dict:
    """With clip_grad below the grad norm, the grads the optimizer used have exactly clip_grad norm."""
    engine = _engine(path, pg["single"], clip_grad=0.05)
    step = engine.train_step(_batches(pg["single"], 2, seed=3), _loss_fn(engine))
    used = torch.sqrt(sum((g.double() ** 2).sum() for g in _grads(engine).values())).item()
    return {"pre_clip_norm": step.grad_norm, "used_norm": used}


def check_non_finite(path: str, pg: dict) -> dict:
    """A NaN loss is skipped (weights, optimizer and schedule untouched) or aborts with a named error."""
    batches = _batches(pg["dp2"], 2, seed=4)
    engine = _engine(path, pg["dp2"], warmup_steps=3)
    first = engine.train_step(batches, _loss_fn(engine))
    before, opt_before = _weights(engine), _opt_tensors(engine)
    skipped = engine.train_step(batches, poisoned(_loss_fn(engine)))
    unchanged = _bitwise(before, _weights(engine)) and _bitwise(opt_before, _opt_tensors(engine))
    after = engine.train_step(batches, _loss_fn(engine))
    grad_skipped = engine.train_step(batches, nan_grads(_loss_fn(engine)))
    message = _abort_message(path, pg, poisoned)
    return {"first_skipped": first.skipped, "skipped": skipped.skipped, "unchanged": unchanged,
            "lrs": [first.lr, skipped.lr, after.lr], "after_skipped": after.skipped,
            "num_steps": engine.num_steps, "message": message,
            "grad_skip": (grad_skipped.skipped, math.isfinite(grad_skipped.loss), math.isnan(grad_skipped.grad_norm)),
            "grad_message": _abort_message(path, pg, nan_grads)}


def _abort_message(path: str, pg: dict, corrupt) -> str:
    from rlhf.train.engine import NonFiniteError

    engine = _engine(path, pg["dp2"], name="critic", nan_policy="abort")
    try:
        engine.train_step(_batches(pg["dp2"], 2, seed=4), corrupt(_loss_fn(engine)))
    except NonFiniteError as error:
        return str(error)
    return ""


def _through_checkpoint(engine, folder: str):
    """Save and load through the checkpoint's own files (full tensors under HF names + a JSON tree, no pickle):
    (state, kind -> folder) for `load_state_dict`."""
    from pathlib import Path

    from rlhf.checkpoint import CheckpointManager, tensor_folders

    manager = CheckpointManager(folder)
    path = manager.save(1, {"engine": engine.state_dict()}, tensors={"engine": engine.checkpoint_tensors()})
    state, manifest = manager.load(Path(path))
    return state["engine"], tensor_folders(Path(path), manifest, "engine")


def check_resume(path: str, pg: dict, layout: str, distributed_optimizer: bool,
                 params_dtype: torch.dtype = torch.float32) -> dict:
    """Save at step 2 of 4 (then offload/reload); a fresh engine (random init) loaded from the save ends
    bitwise equal to the original."""
    pgs = pg[layout]
    batches = [_batches(pgs, 2, seed=10 + i) for i in range(4)]
    optim = dict(warmup_steps=1, decay_style="cosine", total_steps=4, clip_grad=0.5, offload=True,
                 use_distributed_optimizer=distributed_optimizer, params_dtype=params_dtype)
    original = _engine(path, pgs, **optim)
    losses = [original.train_step(b, _loss_fn(original)).loss for b in batches[:2]]
    saved = _through_checkpoint(original, f"{path}-ckpt-{layout}-{distributed_optimizer}-{params_dtype}")
    original.offload()
    original.reload()
    losses += [original.train_step(b, _loss_fn(original)).loss for b in batches[2:]]
    resumed = _engine(path, pgs, load=False, seed=4321, **optim)
    resumed.load_state_dict(*saved)
    resumed_losses = [resumed.train_step(b, _loss_fn(resumed)).loss for b in batches[2:]]
    return {"weights_equal": _bitwise(_weights(original), _weights(resumed)),
            "losses_equal": losses[2:] == resumed_losses, "lr_equal": original.lr == resumed.lr,
            "steps": (original.num_steps, resumed.num_steps), "changed": losses[0] != losses[3]}


def check_reshard(path: str, pg: dict, source: str, target: str) -> dict:
    """Save at step 2 of 4 on `source`, resume on `target` (distributed optimizer on any DP2 side): its steps 3-4
    (losses, LR) match the source's own within fp32 tolerance."""
    batches = [_batches(pg[source], 2, seed=30 + i) for i in range(4)]
    optim = dict(warmup_steps=1, decay_style="cosine", total_steps=4, clip_grad=0.5)
    original = _engine(path, pg[source], use_distributed_optimizer=source == "dp2", **optim)
    losses = [original.train_step(b, _loss_fn(original)).loss for b in batches[:2]]
    saved = _through_checkpoint(original, f"{path}-reshard-{source}-{target}")
    losses += [original.train_step(b, _loss_fn(original)).loss for b in batches[2:]]
    resumed = _engine(path, pg[target], load=False, seed=4321, use_distributed_optimizer=target == "dp2", **optim)
    resumed.load_state_dict(*saved)
    target_batches = [_batches(pg[target], 2, seed=30 + i) for i in range(2, 4)]
    resumed_losses = [resumed.train_step(b, _loss_fn(resumed)).loss for b in target_batches]
    return {"losses": (losses[2:], resumed_losses), "lr_equal": original.lr == resumed.lr,
            "changed": losses[0] != losses[3]}


def check_offload(path: str, pg: dict) -> dict:
    """offload() frees param, optimizer and grad storage; reload() + step is bitwise the no-offload run."""
    pgs = pg["dp2"]
    batches = [_batches(pgs, 1, seed=20 + i) for i in range(2)]
    results = {}
    for distributed_optimizer in (False, True):
        plain = _engine(path, pgs, use_distributed_optimizer=distributed_optimizer)
        plain.offload()  # without optim.offload: nothing happens
        cycled = _engine(path, pgs, use_distributed_optimizer=distributed_optimizer, offload=True)
        for engine in (plain, cycled):
            engine.train_step(batches[0], _loss_fn(engine))
        cycled.offload()
        tensors = list(cycled.module.parameters()) + list(_opt_tensors(cycled, clone=False).values())
        freed = all(t.untyped_storage().nbytes() == 0 for t in tensors if t.numel() > 1)
        grads_freed = all(b.grad_data.untyped_storage().nbytes() == 0 for b in cycled.model.buffers)
        cycled.reload()
        for engine in (plain, cycled):
            engine.train_step(batches[1], _loss_fn(engine))
        results[distributed_optimizer] = {"freed": freed, "grads_freed": grads_freed,
                                          "equal": _bitwise(_weights(plain), _weights(cycled)),
                                          "keep_params": _check_keep_params(path, pgs, batches, plain,
                                                                            distributed_optimizer)}
    return results


def _check_keep_params(path: str, pgs, batches: list, plain, distributed_optimizer: bool) -> dict:
    """offload(keep_params=True) (a colocated engine reads the params) frees only optimizer state and grads."""
    kept = _engine(path, pgs, use_distributed_optimizer=distributed_optimizer, offload=True)
    kept.train_step(batches[0], _loss_fn(kept))
    before = {name: param.clone() for name, param in kept.module.named_parameters()}
    kept.offload(keep_params=True)
    params_resident = all(torch.equal(param, before[name]) for name, param in kept.module.named_parameters())
    state_freed = all(t.untyped_storage().nbytes() == 0 for t in _opt_tensors(kept, clone=False).values()
                      if t.numel() > 1)
    grads_freed = all(b.grad_data.untyped_storage().nbytes() == 0 for b in kept.model.buffers)
    kept.reload()
    kept.train_step(batches[1], _loss_fn(kept))
    return {"params_resident": params_resident, "state_freed": state_freed, "grads_freed": grads_freed,
            "equal": _bitwise(_weights(plain), _weights(kept))}


def engine_world(path: str) -> dict:
    torch.use_deterministic_algorithms(True)
    pg = _groups()
    return {"loss_scaling": check_loss_scaling(path, pg), "layouts": check_layouts(path, pg),
            "forward_only": check_forward_only(path, pg), "sft_learns": check_sft_learns(path, pg),
            "critic": check_critic(path, pg),
            "schedule": check_schedule(path, pg), "clipping": check_clipping(path, pg),
            "non_finite": check_non_finite(path, pg),
            "resume_dp2_distopt": check_resume(path, pg, "dp2", True),
            "resume_pp2": check_resume(path, pg, "pp2", False), "offload": check_offload(path, pg),
            "reshard": {f"{a}->{b}": check_reshard(path, pg, a, b)
                        for a, b in (("dp2", "single"), ("tp2", "dp2"), ("pp2", "tp2"))}}


def engine_world_4(path: str) -> dict:
    """The 4-rank layouts (TP2xDP2, PP2xDP2): parity with one rank and bitwise resume."""
    from rlhf.parallel.groups import GroupCache, build_layout_groups
    from rlhf.parallel.layout import ParallelLayout

    torch.use_deterministic_algorithms(True)
    cache, rank = GroupCache(), dist.get_rank()
    pg = {"tp2dp2": build_layout_groups(ParallelLayout(tp=2, pp=1, dp=2), cache),
          "pp2dp2": build_layout_groups(ParallelLayout(tp=1, pp=2, dp=2), cache)}
    pg["single"] = [build_layout_groups(ParallelLayout(tp=1, pp=1, dp=1, first_rank=r), cache)
                    for r in range(4)][rank]
    return {"layouts": check_layouts(path, pg, ("tp2dp2", "pp2dp2", "tp2dp2_distopt", "pp2dp2_distopt")),
            "resume_tp2dp2_distopt": check_resume(path, pg, "tp2dp2", True),
            "resume_pp2dp2": check_resume(path, pg, "pp2dp2", False)}


def engine_world_bf16(path: str) -> dict:
    """bf16 params (megatron's mixed-precision optimizers) at DP2: bitwise resume through offload."""
    torch.use_deterministic_algorithms(True)
    pg = _groups()
    return {f"distributed_optimizer={flag}": check_resume(path, pg, "dp2", flag, params_dtype=torch.bfloat16)
            for flag in (False, True)}
