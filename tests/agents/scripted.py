"""Test helpers for multi-turn rollouts: a scripted engine, tools that fail or hang, a run helper."""

import time

import torch

from rlhf.agents.config import TurnLimits
from rlhf.agents.rollout import MultiTurnRollout
from rlhf.agents.tools import Calculator, ToolBox, ToolSpec
from rlhf.data.records import PromptRecord
from rlhf.rollout.engine import EngineLayout
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import FinishReason, Rollouts

CALL = '<tool_call>{"name": "%s", "arguments": {"expression": "%s"}}</tool_call>'


class ScriptedEngine:
    """Answers turn k of the conversation whose first user message is q with script[q][k - 1]."""

    layout = EngineLayout()
    policy_version = 3

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompts, params):
        rows, reasons = [], []
        self.calls.append(prompts.num_prompts)
        for index in range(prompts.num_prompts):
            text = self.tokenizer.decode(prompts.prompt(index))
            question = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            turn = text.count("<|im_start|>assistant")
            answer = self.script[question][turn - 1]
            ids = self.tokenizer.encode(answer, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            reasons.append(FinishReason.STOP if len(ids) <= params.max_new_tokens else FinishReason.LENGTH)
            rows.append(ids[:params.max_new_tokens])
        width = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r)
            logprobs[i, :len(r)] = -0.01 * torch.arange(1, len(r) + 1)
        return Rollouts(response_tokens_rt=tokens, response_logprobs_rt=logprobs, response_scaled_logprobs_rt=None,
                        response_lengths_r=torch.tensor([len(r) for r in rows]), finish_reasons=reasons,
                        prompt_index_r=torch.arange(len(rows)), policy_version=self.policy_version)


def record(question, index=0, **extra):
    return PromptRecord(prompt=[{"role": "user", "content": question}], data_source="t", ground_truth=None,
                        extra_info=extra, index=index)


class Flaky:
    schema = Calculator.schema

    def __init__(self, failures):
        self.failures = failures

    def call(self, arguments, **kwargs):
        if self.failures:
            self.failures -= 1
            raise OSError("sandbox vanished")
        return "ok"


class Hangs:
    schema = {"type": "function", "function": {"name": "hang", "parameters": {"type": "object"}}}

    def call(self, arguments, **kwargs):
        time.sleep(30)


def toolbox(**tools):
    return ToolBox(tools, {name: ToolSpec.parse(tool.schema if name != "flaky" else {
        "type": "function", "function": {"name": "flaky", "parameters": Calculator.schema["function"]["parameters"]}},
        name) for name, tool in tools.items()})


def run(tokenizer, script, records, n=1, **limits):
    engine = ScriptedEngine(tokenizer, script)
    tools = toolbox(calculator=Calculator(), flaky=Flaky(limits.pop("failures", 0)), hang=Hangs())
    rollout = MultiTurnRollout(tokenizer, TurnLimits(**limits), tools)
    result = rollout.collect(engine, records, SamplingParams(max_new_tokens=limits.get("token_budget", 512), n=n),
                             pad_token_id=0)
    return result, engine
