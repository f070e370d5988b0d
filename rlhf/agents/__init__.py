"""Multi-turn rollouts on the rollout side of the step: agent functions and environments over the in-process
engine, token-in/token-out (sampled tokens are never re-encoded; only new observation messages are rendered).

  trajectory.py  the token record of one rollout: spans, loss mask, logprobs, versions, forks, termination
  render.py      chat-template rendering of new messages and the per-turn prefix check (history policy)
  tool_calls.py  Hermes/Qwen-style `<tool_call>` parsing on token ids
  tools.py       tool declarations (OpenAI function schema, YAML tool config) and the calculator
  python_tool.py Python execution in a resource-limited subprocess (not a security sandbox)
"""
