"""Multi-turn rollouts on the rollout side of the step: agent functions and environments over the in-process
engine, token-in/token-out (sampled tokens are never re-encoded; only new observation messages are rendered).

  config.py      the `multiturn` section (torch-free): agent, tool config, limits, history policy
  trajectory.py  the token record of one rollout: rows, sampled-only loss mask, logprobs, versions, termination
  render.py      chat-template rendering of new messages and the per-turn prefix check (append | fork)
  tool_calls.py  Hermes/Qwen-style `<tool_call>` parsing on token ids
  tools.py       tool declarations (OpenAI function schema, verl's YAML tool config) and the calculator
  python_tool.py Python execution in a resource-limited subprocess (not a security sandbox)
  scheduler.py   turn-batched generation: every parked trajectory's next turn in one engine call
  agent.py       the agent context, the built-in tool loop and the environment adapter
  rollout.py     one multi-turn rollout call: n trajectories per prompt, dropped groups, multiturn/* metrics
  batch.py       trajectories as padded training rows
"""
