"""Everything the engine tests check, run in ONE 2-rank gloo world (launches are expensive here).

Each `check_*` builds fresh engines on layouts of the shared world and returns plain numbers/strings; the
test module asserts on them.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist

from tests.train.helpers import global_batch, make_nll_loss, shard_rows, shard_state, split, tiny_config


def _groups():
    from rlhf.dist.groups import GroupCache, build_layout_groups
    from rlhf.dist.layout import ParallelLayout

    cache, rank = GroupCache(), dist.get_rank()
    dp2 = build_layout_groups(ParallelLayout(tp=1, pp=1, dp=2), cache)
    tp2 = build_layout_groups(ParallelLayout(tp=2, pp=1, dp=1), cache)
    single = [build_layout_groups(ParallelLayout(tp=1, pp=1, dp=1, first_rank=r), cache) for r in range(2)]
    return {"dp2": dp2, "tp2": tp2, "single": single[rank]}


def _engine(pgs, seed: int = 1234, name: str = "actor", **optim):
    from rlhf.models.builder import build_gpt
    from rlhf.train.config import OptimConfig
    from rlhf.train.engine import TrainEngine

    optim = {"lr": 1e-2, "total_steps": 10, **optim}
    return TrainEngine(build_gpt(tiny_config(), pgs, seed=seed), pgs, OptimConfig(**optim), name=name)


def _grads(engine) -> dict:
    return {n: p.main_grad.clone() for n, p in engine.module.named_parameters()}


def _weights(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def check_loss_scaling(pg: dict) -> dict:
    """Global-count loss: same loss and grads at DP=2 vs DP=1 and at 1 vs 2 micro-batches."""
    tokens, mask = global_batch(8, 16, seed=0)
    results = {}
    for key, pgs, batches in (("dp2_m2", pg["dp2"], shard_rows(split(tokens, mask, 2), dist.get_rank(), 2)),
                              ("dp1_m1", pg["single"], split(tokens, mask, 1)),
                              ("dp1_m2", pg["single"], split(tokens, mask, 2))):
        engine = _engine(pgs, clip_grad=0.0)
        step = engine.train_step(batches, make_nll_loss(pgs.tp))
        results[key] = (step.loss, step.grad_norm, _grads(engine))
    ref_loss, ref_norm, ref_grads = results["dp1_m1"]
    return {key: {"loss_diff": abs(loss - ref_loss), "norm_diff": abs(norm - ref_norm),
                  "grad_diff": _max_diff(grads, ref_grads), "loss": loss}
            for key, (loss, norm, grads) in results.items() if key != "dp1_m1"}


def check_tp(pg: dict) -> dict:
    """TP2 vs TP1 from the same weights: losses and grad norms of two steps."""
    tokens, mask = global_batch(4, 16, seed=1)
    loss_fn_1, loss_fn_2 = make_nll_loss(pg["single"].tp), make_nll_loss(pg["tp2"].tp)
    tp1 = _engine(pg["single"])
    tp2 = _engine(pg["tp2"], seed=99)
    tp2.module.load_state_dict(shard_state(tp1.module.state_dict(), 2, pg["tp2"].tp.rank()))
    out = []
    for _ in range(3):
        one = tp1.train_step(split(tokens, mask, 2), loss_fn_1)
        two = tp2.train_step(split(tokens, mask, 2), loss_fn_2)
        out.append((one.loss, two.loss, one.grad_norm, two.grad_norm))
    return {"steps": out}


def check_schedule(pg: dict) -> dict:
    """LR used by each of 8 steps: warmup 2 then cosine to min_lr at step 6, then min_lr."""
    tokens, mask = global_batch(2, 8, seed=2)
    engine = _engine(pg["single"], lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_style="cosine", total_steps=6)
    return {"lrs": [engine.train_step(split(tokens, mask, 1), make_nll_loss(pg["single"].tp)).lr
                    for _ in range(8)]}


def check_clipping(pg: dict) -> dict:
    """With clip_grad below the grad norm, the grads the optimizer used have exactly clip_grad norm."""
    tokens, mask = global_batch(4, 16, seed=3)
    engine = _engine(pg["single"], clip_grad=0.05)
    step = engine.train_step(split(tokens, mask, 2), make_nll_loss(pg["single"].tp))
    used = torch.sqrt(sum((g.double() ** 2).sum() for g in _grads(engine).values())).item()
    return {"pre_clip_norm": step.grad_norm, "used_norm": used}


def check_non_finite(pg: dict) -> dict:
    """A NaN loss is skipped (weights, optimizer and schedule untouched) or aborts with a named error."""
    from rlhf.train.engine import NonFiniteError

    tokens, mask = global_batch(4, 16, seed=4)
    loss_fn = make_nll_loss(pg["dp2"].tp)
    rank = dist.get_rank()
    good = shard_rows(split(tokens, mask, 2), rank, 2)
    bad = shard_rows(split(tokens, mask, 2, poison=True), rank, 2)
    engine = _engine(pg["dp2"], warmup_steps=3)
    first = engine.train_step(good, loss_fn)
    before, opt_before = _weights(engine), _opt_tensors(engine)
    skipped = engine.train_step(bad, loss_fn)
    unchanged = _bitwise(before, _weights(engine)) and _bitwise(opt_before, _opt_tensors(engine))
    after = engine.train_step(good, loss_fn)
    aborting = _engine(pg["dp2"], name="critic", nan_policy="abort")
    try:
        aborting.train_step(bad, loss_fn)
        message = ""
    except NonFiniteError as error:
        message = str(error)
    return {"first_skipped": first.skipped, "skipped": skipped.skipped, "unchanged": unchanged,
            "lrs": [first.lr, skipped.lr, after.lr], "after_skipped": after.skipped,
            "after_finite": after.loss == after.loss, "num_steps": engine.num_steps, "message": message}


def _opt_tensors(engine, clone: bool = True) -> dict:
    out = {}
    for i, part in enumerate(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])):
        for j, state in enumerate(part.optimizer.state.values()):
            out.update({f"{i}.{j}.{k}": v.clone() if clone else v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def check_resume(pg: dict, layout: str, distributed_optimizer: bool) -> dict:
    """Save at step 2 of 4; a fresh engine (other init) loaded from it ends bitwise equal to the original."""
    pgs, rank = pg[layout], dist.get_rank()
    dp = pgs.dp.size()
    batches = [shard_rows(split(*global_batch(4, 16, seed=10 + i), 2), pgs.dp.rank(), dp) for i in range(4)]
    loss_fn = make_nll_loss(pgs.tp)
    optim = dict(warmup_steps=1, decay_style="cosine", total_steps=4, clip_grad=0.5,
                 use_distributed_optimizer=distributed_optimizer)
    original = _engine(pgs, **optim)
    losses = [original.train_step(b, loss_fn).loss for b in batches[:2]]
    saved = _roundtrip(original.state_dict())
    losses += [original.train_step(b, loss_fn).loss for b in batches[2:]]
    resumed = _engine(pgs, seed=4321 + rank, **optim)
    resumed.load_state_dict(saved)
    resumed_losses = [resumed.train_step(b, loss_fn).loss for b in batches[2:]]
    return {"weights_equal": _bitwise(_weights(original), _weights(resumed)),
            "losses_equal": losses[2:] == resumed_losses, "lr_equal": original.lr == resumed.lr,
            "steps": (original.num_steps, resumed.num_steps), "changed": losses[0] != losses[3]}


def check_offload(pg: dict) -> dict:
    """offload() frees param, optimizer and grad storage; reload() + step is bitwise the no-offload run."""
    pgs = pg["dp2"]
    batches = [shard_rows(split(*global_batch(4, 16, seed=20 + i), 2), pgs.dp.rank(), 2) for i in range(2)]
    loss_fn = make_nll_loss(pgs.tp)
    results = {}
    for distributed_optimizer in (False, True):
        plain = _engine(pgs, use_distributed_optimizer=distributed_optimizer)
        cycled = _engine(pgs, use_distributed_optimizer=distributed_optimizer)
        for engine in (plain, cycled):
            engine.train_step(batches[0], loss_fn)
        cycled.offload()
        tensors = list(cycled.module.parameters()) + list(_opt_tensors(cycled, clone=False).values())
        freed = all(t.untyped_storage().nbytes() == 0 for t in tensors if t.numel() > 1)
        grads_freed = all(b.grad_data.untyped_storage().nbytes() == 0 for b in cycled.model.buffers)
        cycled.reload()
        for engine in (plain, cycled):
            engine.train_step(batches[1], loss_fn)
        results[distributed_optimizer] = {"freed": freed, "grads_freed": grads_freed,
                                          "equal": _bitwise(_weights(plain), _weights(cycled))}
    return results


def engine_world() -> dict:
    torch.use_deterministic_algorithms(True)
    pg = _groups()
    return {"loss_scaling": check_loss_scaling(pg), "tp": check_tp(pg), "schedule": check_schedule(pg),
            "clipping": check_clipping(pg), "non_finite": check_non_finite(pg),
            "resume_dp2_distopt": check_resume(pg, "dp2", True), "resume_tp2": check_resume(pg, "tp2", False),
            "offload": check_offload(pg)}
