"""`<tool_call>` parsing on token ids."""

import pytest

from rlhf.agents.tool_calls import ToolCall, ToolCallParser
from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.errors import ConfigError


@pytest.fixture(scope="module")
def parser(chat_tokenizer):
    return ToolCallParser(chat_tokenizer)


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_calls_in_order(parser, chat_tokenizer):
    text = ('a<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>b'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert parser.parse(_ids(chat_tokenizer, text), max_calls=4) == [
        ToolCall("calculator", {"expression": "1+2"}), ToolCall("python", {"code": "print(1)"})]


def test_markers_are_token_ids_not_text(parser, chat_tokenizer):
    spelled = [chat_tokenizer.convert_tokens_to_ids(char) for char in '<tool_call>{"name": "x"}</tool_call>']
    assert parser.parse(spelled, max_calls=4) == []  # the marker spelled out in characters is no call


@pytest.mark.parametrize("body, error", [
    ("{not json", "tool call is not valid JSON"),
    ('["calculator"]', 'tool call must be {"name": str, "arguments": object}'),
    ('{"name": "calculator", "arguments": [1]}', "tool call arguments must be an object"),
])
def test_malformed_calls_are_reported_not_raised(parser, chat_tokenizer, body, error):
    (call,) = parser.parse(_ids(chat_tokenizer, f"<tool_call>{body}</tool_call>"), max_calls=2)
    assert call.error.startswith(error)


def test_unterminated_and_too_many(parser, chat_tokenizer):
    (call,) = parser.parse(_ids(chat_tokenizer, '<tool_call>{"name": "a"}'), max_calls=2)
    assert call.error == "unterminated tool call: no </tool_call> after <tool_call>"
    calls = parser.parse(_ids(chat_tokenizer, '<tool_call>{"name": "a"}</tool_call>' * 3), max_calls=2)
    assert [c.name for c in calls] == ["a", "a", ""]
    assert calls[2].error == "more than 2 tool calls in one turn; make at most 2"


def test_tokenizer_that_cannot_encode_markers():
    with pytest.raises(ConfigError, match="the tokenizer cannot encode the tool-call markers"):
        ToolCallParser(build_char_tokenizer("0123456789"))
