"""`rlhf init-model`: a fresh random Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral HF folder with a char-level tokenizer (start from nothing)."""

from __future__ import annotations

import argparse

ARITHMETIC_ALPHABET = "0123456789+-= "  # the default of rlhf.data.char_tokenizer (kept light to import)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("init-model", help="write a randomly initialised small model + char tokenizer")
    parser.add_argument("--out", required=True, help="output folder (HF format)")
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--max-positions", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8, help="MoE archs: experts per layer")
    parser.add_argument("--experts-per-token", type=int, default=2, help="MoE archs: experts each token uses")
    parser.add_argument("--expert-ffn", type=int, default=128, help="qwen3_moe: the experts' width")
    parser.add_argument("--alphabet", default=None,
                        help=f"characters of the char tokenizer (default {ARITHMETIC_ALPHABET!r}; with --chat every "
                             "printable ASCII character and the newline)")
    parser.add_argument("--chat", action="store_true",
                        help="ChatML markers and <tool_call> tokens as special tokens, EOS <|im_end|>, a ChatML "
                             "template with a tool role (multi-turn tool use)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run(args: argparse.Namespace) -> int:
    from rlhf.data.char_tokenizer import CHAT_ALPHABET, build_char_tokenizer, build_chat_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    config = InitModelConfig(arch=args.arch, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                             num_kv_heads=args.kv_heads, intermediate_size=args.ffn,
                             max_position_embeddings=args.max_positions, num_experts=args.experts,
                             num_experts_per_token=args.experts_per_token, expert_intermediate_size=args.expert_ffn,
                             seed=args.seed)
    if args.chat:
        tokenizer = build_chat_char_tokenizer(args.alphabet or CHAT_ALPHABET)
    else:
        tokenizer = build_char_tokenizer(args.alphabet or ARITHMETIC_ALPHABET)
    out = init_hf_model(config, tokenizer, args.out)
    print(f"wrote {out}")
    return 0
