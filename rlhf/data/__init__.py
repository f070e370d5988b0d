"""Prompt datasets: verl-schema records, tokenization with a length policy, DP-sharded sampling, making."""
