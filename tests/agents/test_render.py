"""Token-in/token-out rendering: the canonical prompt, the delta of new messages and the history policies."""

import pytest

from rlhf.agents.config import HistoryPolicy
from rlhf.agents.render import ChatRenderer
from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.errors import ConfigError

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
TURNS = ['<think>12 and 30</think><tool_call>{"name": "calculator", "arguments": {"expression": "12*30"}}</tool_call>',
         "<think>done</think>360"]


def _play(renderer, policy):
    """A conversation whose assistant turns are 'sampled' token ids (their text + the stop token); returns the
    rows it builds as (prompt tokens, held tokens) per turn and how each turn's next prompt was made."""
    tokenizer = renderer.tokenizer
    messages = [{"role": "user", "content": "What is 12*30?"}]
    held = renderer.prompt(messages)
    steps = []
    for text in TURNS:
        sampled = renderer.encode(text) + [tokenizer.eos_token_id]
        held = held + sampled
        messages.append({"role": "assistant", "content": text})
        new = [{"role": "tool", "content": "360"}]
        messages.extend(new)
        nxt = renderer.next_prompt(held, messages, new, policy)
        steps.append((list(held), nxt))
        held = nxt.tokens
    return steps, messages


@pytest.mark.parametrize("policy", list(HistoryPolicy))
def test_prefix_preserving_template_equals_apply_chat_template(chat_tokenizer, policy):
    renderer = ChatRenderer(chat_tokenizer, tools=TOOLS)
    steps, messages = _play(renderer, policy)
    for (held, nxt), end in zip(steps, (3, 5)):
        expected = chat_tokenizer.encode(chat_tokenizer.apply_chat_template(
            messages[:end], tools=TOOLS, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        assert nxt.tokens == expected and not nxt.mismatch and not nxt.fork
        assert nxt.tokens[:len(held)] == held
        # the delta of the new messages alone gives the same tokens after the held ones
        assert held + renderer.delta([{"role": "tool", "content": "360"}]) == expected


def test_history_rewriting_template_forks_exactly_where_it_rewrites(rewriting_tokenizer):
    renderer = ChatRenderer(rewriting_tokenizer)
    steps, messages = _play(renderer, HistoryPolicy.FORK)
    (held1, first), (held2, second) = steps
    assert first.fork and first.mismatch  # turn 1's <think> block is dropped from the history at turn 2
    expected = rewriting_tokenizer.encode(rewriting_tokenizer.apply_chat_template(
        messages[:3], tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert first.tokens == expected and "<think>" not in rewriting_tokenizer.decode(first.tokens)
    assert second.fork  # and again after turn 2's


def test_append_policy_keeps_what_the_model_read(rewriting_tokenizer):
    renderer = ChatRenderer(rewriting_tokenizer)
    steps, _ = _play(renderer, HistoryPolicy.APPEND)
    for held, nxt in steps:
        assert nxt.mismatch and not nxt.fork
        assert nxt.tokens == held + renderer.delta([{"role": "tool", "content": "360"}])
    assert "<think>12 and 30</think>" in rewriting_tokenizer.decode(steps[1][1].tokens)


def test_template_without_tool_role_is_one_line():
    tokenizer = build_char_tokenizer("abc")
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                               "{{ raise_exception('roles must be user/assistant') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    renderer = ChatRenderer(tokenizer)
    with pytest.raises(ConfigError, match=r"the chat template cannot render roles \['assistant', 'tool', 'user'\]"):
        renderer.delta([{"role": "tool", "content": "a"}])


def test_tokenizer_without_template():
    tokenizer = build_char_tokenizer("abc")
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="multi-turn rollouts need a tokenizer with a chat template"):
        ChatRenderer(tokenizer)


def test_multiturn_config_errors():
    from rlhf.agents.config import MultiTurnConfig, TurnLimits

    with pytest.raises(ConfigError, match="^multiturn.agent=tools needs multiturn.tool_config"):
        MultiTurnConfig(enable=True)
    with pytest.raises(ConfigError, match=r"^multiturn.agent='calc': use 'tools' or path/to/file.py:function$"):
        MultiTurnConfig(enable=True, agent="calc")
    with pytest.raises(ConfigError, match=r"^multiturn.limits.max_turns=0 must be >= 1$"):
        TurnLimits(max_turns=0)
    assert not MultiTurnConfig().enable  # off needs nothing
