"""Build a native engine on this rank's world (tp = world size) from an HF folder: (engine, model, groups)."""

import torch.distributed as dist


def native_engine(path, *, max_batch_size, max_seq_len, eos=(), dtype=None, **config):
    import torch

    from transformers import AutoConfig

    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import load_hf_weights
    from rlhf.rollout.factory import engine_layout
    from rlhf.rollout.native import NativeEngine, NativeEngineConfig

    pgs = build_layout_groups(ParallelLayout(tp=dist.get_world_size()))
    hf_config = AutoConfig.from_pretrained(path)
    model = build_gpt(hf_config, pgs, params_dtype=dtype or torch.float32)
    load_hf_weights(model, path)
    engine = NativeEngine(model, vocab_size=hf_config.vocab_size, eos_token_ids=eos, layout=engine_layout(pgs),
                          tp_group=pgs.tp,
                          config=NativeEngineConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len, **config))
    return engine, model, pgs
