"""The request parsing: fields refused with a 400 naming them, not a 500; a tiny temperature or top_p kept finite;
null read as absent; tool turns spelled out for ChatML."""

from __future__ import annotations

import pytest
import torch

from specchat.config import SpecParams
from specchat.server.protocol import ApiError, parse_request, with_tools


def assistant_calling(tool_calls) -> dict:
    return {
        "messages": [{"role": "user", "content": "w"}, {"role": "assistant", "content": None, "tool_calls": tool_calls}]
    }


@pytest.mark.parametrize(
    "tool_calls",
    [
        "junk",
        ["junk"],
        [{"function": "x"}],
        [{"function": {"arguments": "{}"}}],
        [{"function": {"name": "add", "arguments": "[1, 2]"}}],
        [{"function": {"name": "add", "arguments": "{not json"}}],
        [{"function": {"name": "add", "arguments": 3}}],
        [{"function": {"name": "add", "arguments": '{"a": ' * 5000 + "1" + "}" * 5000}}],  # a RecursionError: a 500
        [{"function": {"name": "add", "arguments": '{"a": 1' + "0" * 5000 + "}"}}],  # past 4,300 digits: a 500
    ],
)
def test_malformed_tool_calls_in_history_are_a_400(tool_calls) -> None:
    with pytest.raises(ApiError) as refused:
        parse_request(assistant_calling(tool_calls), chat=True, default_spec=SpecParams())
    assert refused.value.status == 400 and refused.value.param == "messages" and "tool_calls" in refused.value.message


def test_a_well_formed_tool_call_in_history_is_read_as_a_dict() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    req = parse_request(assistant_calling(calls), chat=True, default_spec=SpecParams())
    assert req.prompt[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1}}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("temperature", 2.5),
        ("top_p", 2),
        ("top_k", -3),
        ("seed", -(1 << 63) - 1),
        ("seed", 1 << 64),
    ],
)
def test_a_bad_sampling_field_is_named_in_the_error(field: str, value) -> None:
    body = {"messages": [{"role": "user", "content": "w"}], field: value}
    with pytest.raises(ApiError) as refused:
        parse_request(body, chat=True, default_spec=SpecParams())
    assert refused.value.status == 400 and refused.value.param == field


def test_any_64_bit_seed_is_taken_as_vllm_takes_it() -> None:
    """Some clients send seed -1; a negative seed is its two's complement, each a reproducible text of its own."""
    seeds = []
    for seed in (-1, -2, -(1 << 63), 0, (1 << 64) - 1):
        body = {"messages": [{"role": "user", "content": "w"}], "seed": seed, "temperature": 1}
        seeds.append(parse_request(body, chat=True, default_spec=SpecParams()).sampling.seed)
    assert seeds == [(1 << 64) - 1, (1 << 64) - 2, 1 << 63, 0, (1 << 64) - 1]


def test_temperature_two_is_accepted_as_openai_accepts_it() -> None:
    body = {"messages": [{"role": "user", "content": "w"}], "temperature": 2}
    assert parse_request(body, chat=True, default_spec=SpecParams()).sampling.temperature == 2.0


def test_ignore_eos_is_read_as_vllm_reads_it() -> None:
    """Benchmark clients send vLLM's ignore_eos to get answers of max_tokens; it was accepted and dropped."""
    body = {"messages": [{"role": "user", "content": "w"}]}
    assert not parse_request(body, chat=True, default_spec=SpecParams()).sampling.ignore_eos
    assert parse_request({**body, "ignore_eos": True}, chat=True, default_spec=SpecParams()).sampling.ignore_eos
    with pytest.raises(ApiError) as refused:
        parse_request({**body, "ignore_eos": "yes"}, chat=True, default_spec=SpecParams())
    assert refused.value.status == 400 and refused.value.param == "ignore_eos"


ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_a_token_limit_of_zero_or_less_is_a_400_naming_its_field(field: str, value: int) -> None:
    """max_completion_tokens: 0 was read as absent: the answer ran to the context."""
    body = {"messages": [{"role": "user", "content": "w"}], "max_tokens": 5, field: value}
    with pytest.raises(ApiError) as refused:
        parse_request(body, chat=True, default_spec=SpecParams())
    assert refused.value.status == 400 and refused.value.param == field and field in refused.value.message


def test_max_completion_tokens_rules_over_max_tokens() -> None:
    body = {"messages": [{"role": "user", "content": "w"}], "max_completion_tokens": 3, "max_tokens": 9}
    assert parse_request(body, chat=True, default_spec=SpecParams()).max_tokens == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        ("response_format", "json"),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("presence_penalty", "abc"),
        ("frequency_penalty", True),
        ("logit_bias", {"50256": -100}),
        ("logit_bias", [1, 2]),
        ("functions", [{"name": "add", "parameters": {}}]),
        ("function_call", {"name": "add"}),
        ("function_call", 3),
    ],
)
@pytest.mark.parametrize("chat", [True, False])
def test_output_shaping_the_engine_does_not_do_is_a_400_naming_the_field(field: str, value, chat: bool) -> None:
    """A JSON mode, penalties, a logit bias, legacy functions were accepted and silently not done."""
    body = {"messages": [{"role": "user", "content": "w"}], "prompt": "w", field: value}
    with pytest.raises(ApiError) as refused:
        parse_request(body, chat=chat, default_spec=SpecParams())
    assert refused.value.status == 400 and refused.value.param == field and field in refused.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "text"}},
        {"presence_penalty": 0, "frequency_penalty": 0.0},
        {"logit_bias": {}},
        {"functions": [], "function_call": "none"},
        {
            "response_format": None,
            "presence_penalty": None,
            "logit_bias": None,
            "functions": None,
            "function_call": None,
        },
    ],
)
def test_output_shaping_values_that_ask_for_nothing_are_accepted(fields: dict) -> None:
    """Many clients send these explicitly."""
    body = {"messages": [{"role": "user", "content": "w"}], **fields}
    assert parse_request(body, chat=True, default_spec=SpecParams()).chat


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("value", [0, 1, 5, True])
def test_any_logprobs_asked_for_is_a_400(chat: bool, value) -> None:
    """/v1/completions' `logprobs: 0` (the chosen tokens' logprobs) passed as absent (0 == False) and got none."""
    body = {"messages": [{"role": "user", "content": "w"}], "prompt": "w", "logprobs": value}
    with pytest.raises(ApiError) as refused:
        parse_request(body, chat=chat, default_spec=SpecParams())
    assert refused.value.status == 400 and refused.value.param == "logprobs"


@pytest.mark.parametrize("chat", [True, False])
def test_logprobs_false_or_null_is_accepted(chat: bool) -> None:
    for value in (False, None):
        body = {"messages": [{"role": "user", "content": "w"}], "prompt": "w", "logprobs": value, "top_logprobs": 0}
        assert parse_request(body, chat=chat, default_spec=SpecParams()).chat == chat


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1e-300},
        {"temperature": 1e-40},
        {"temperature": 5e-324, "top_p": 5e-324},
        {"top_p": 1e-300},
        {"top_p": 1e-50, "top_k": 3},
    ],
)
def test_a_tiny_temperature_or_top_p_samples_finite_probabilities(fields: dict) -> None:
    """temperature 1e-300 or top_p 1e-300 made the sampler's probabilities NaN: the engine step failed, and with it
    every answer in the batch (other clients' streams ended with the error)."""
    from specchat.engine.sampling import probs_from_logits

    body = {"messages": [{"role": "user", "content": "w"}], **fields}
    sampling = parse_request(body, chat=True, default_spec=SpecParams()).sampling
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(0)) * 30
    if not sampling.greedy:
        probs = probs_from_logits(logits, sampling)
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
        assert (probs.argmax(-1) == logits.argmax(-1)).all() and (probs.max(-1).values == 1).all()


def test_small_but_usable_temperatures_and_top_p_are_kept() -> None:
    body = {"messages": [{"role": "user", "content": "w"}], "temperature": 0.01, "top_p": 0.001}
    sampling = parse_request(body, chat=True, default_spec=SpecParams()).sampling
    assert sampling.temperature == 0.01 and sampling.top_p == 0.001
    for top_p in (-0.1, float("nan"), 1.5):
        with pytest.raises(ApiError) as refused:
            parse_request({**body, "top_p": top_p}, chat=True, default_spec=SpecParams())
        assert refused.value.param == "top_p"


def test_a_null_drafter_or_k_is_the_servers_default() -> None:
    """`"drafter": null` (a client's extra_body with None) was a 400 "drafter must be a string"; null is absent."""
    default = SpecParams(drafter="ngram", k=3)
    body = {"messages": [{"role": "user", "content": "w"}], "drafter": None, "k": None}
    spec = parse_request(body, chat=True, default_spec=default).spec
    assert spec.drafter == "ngram" and spec.k == 3
    assert parse_request(body, chat=True, default_spec=SpecParams(drafter="none", k=None)).spec.k is None


CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
)


@pytest.mark.parametrize("tool_choice", ["none", None])
def test_tool_turns_are_spelled_out_for_chatml_without_tools_too(tool_choice) -> None:
    """tool_choice "none" (or a follow-up without `tools`) gave SmolLM2's ChatML the history as it came: the
    assistant's call rendered as an empty turn, the result as a "tool" turn."""
    call = {"id": "abc", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    body = {
        "messages": [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "abc", "content": "1"},
        ],
        "tools": [ADD_TOOL] if tool_choice else None,
        "tool_choice": tool_choice,
    }
    req = parse_request(body, chat=True, default_spec=SpecParams())
    messages, tools = with_tools(req.prompt, req.tools, CHATML)
    assert tools is None and [m["role"] for m in messages] == ["user", "assistant", "user"]  # no tools prompt
    assert messages[1]["content"] == '<tool_call>[{"name": "add", "arguments": {"a": 1}}]</tool_call>'
    assert messages[2]["content"] == "<tool_response>\n1\n</tool_response>"
    assert not any("tool_calls" in m for m in messages)


def test_a_tool_turns_null_id_and_name_are_absent_not_the_text_none() -> None:
    """`"name": null` reached the template as the string "None"; a non-string is refused."""
    user = {"role": "user", "content": "add"}
    tool = {"role": "tool", "tool_call_id": None, "name": None, "content": "1"}
    req = parse_request({"messages": [user, tool]}, chat=True, default_spec=SpecParams())
    assert req.prompt[1]["tool_call_id"] == "" and req.prompt[1]["name"] == ""
    with pytest.raises(ApiError, match=r"messages\[1\]\.name must be a string"):
        parse_request({"messages": [user, {**tool, "name": 5}]}, chat=True, default_spec=SpecParams())


def test_a_plain_history_without_tools_is_passed_as_it_came() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert with_tools(messages, [], CHATML) == (messages, None)


def test_completions_default_to_openais_16_tokens_and_chat_to_the_context() -> None:
    """/v1/completions without max_tokens ran to the context (8,192 tokens of a base model that seldom ends, minutes
    on the CPU); OpenAI's and vLLM's default there is 16. Chat's stays the context, as OpenAI's."""
    assert parse_request({"prompt": "w"}, chat=False, default_spec=SpecParams()).max_tokens == 16
    assert parse_request({"prompt": "w", "max_tokens": None}, chat=False, default_spec=SpecParams()).max_tokens == 16
    assert parse_request({"prompt": "w", "max_tokens": 40}, chat=False, default_spec=SpecParams()).max_tokens == 40
    chat = {"messages": [{"role": "user", "content": "w"}]}
    assert parse_request(chat, chat=True, default_spec=SpecParams()).max_tokens is None


def test_top_p_zero_is_greedy_and_top_k_minus_one_is_off() -> None:
    """top_p 0 (in OpenAI's range, 0 to 1: the top token alone, which clients send for repeatable answers) and top_k
    -1 (vLLM's "off", which clients written for vLLM send) were 400s."""
    body = {"messages": [{"role": "user", "content": "w"}], "temperature": 0.7}
    sampling = parse_request({**body, "top_p": 0}, chat=True, default_spec=SpecParams()).sampling
    assert sampling.greedy and sampling.top_p == 1.0
    sampling = parse_request({**body, "top_k": -1}, chat=True, default_spec=SpecParams()).sampling
    assert sampling.top_k == 0 and sampling.temperature == 0.7


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 0}}, "stream_options"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ],
)
def test_a_wrong_type_inside_an_object_is_a_400(fields: dict, param: str) -> None:
    """`include_usage: "no"` sent the usage (any non-empty string is true), and a text part's text of 5 or none at
    all went to the model as "5" or ""."""
    body = {"messages": [{"role": "user", "content": "w"}], **fields}
    with pytest.raises(ApiError) as refused:
        parse_request(body, chat=True, default_spec=SpecParams())
    assert refused.value.status == 400 and refused.value.param == param


def test_include_usage_true_false_or_null_is_read() -> None:
    body = {"messages": [{"role": "user", "content": "w"}], "stream": True}
    for value, wanted in ((True, True), (False, False), (None, False)):
        req = parse_request({**body, "stream_options": {"include_usage": value}}, chat=True, default_spec=SpecParams())
        assert req.include_usage is wanted


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
@pytest.mark.parametrize(
    "function",
    [{"name": {"a": 1}}, {"name": 5}, {"name": ""}, {"name": "f", "parameters": [1]}, {"name": "f", "description": 5}],
)
def test_a_malformed_tool_is_a_400_naming_tools(function: dict, tool_choice) -> None:
    """A function named by an object passed, the answer was written, and then naming the declared functions raised:
    a plain-text 500 after the whole answer, or a stream cut without its end; a name of 5 reached the template."""
    body = {"messages": [{"role": "user", "content": "w"}], "tools": [{"type": "function", "function": function}]}
    with pytest.raises(ApiError) as refused:
        parse_request({**body, "tool_choice": tool_choice}, chat=True, default_spec=SpecParams())
    assert refused.value.status == 400 and refused.value.param == "tools"


def test_a_tool_with_null_or_absent_description_and_parameters_is_accepted() -> None:
    body = {"messages": [{"role": "user", "content": "w"}]}
    functions = [{"name": "f"}, {"name": "f", "description": None, "parameters": None}, ADD_TOOL["function"]]
    tools = [{"type": "function", "function": function} for function in functions]
    assert parse_request({**body, "tools": tools}, chat=True, default_spec=SpecParams()).tools == tools


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("stream", [{}, {"stream": False}, {"stream": None}])
@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": False}, {}])
def test_stream_options_without_stream_is_a_400(chat: bool, stream: dict, options: dict) -> None:
    """Accepted silently: a client that asked for usage in a stream it never opened was not told, as OpenAI and vLLM
    tell it."""
    body = {"messages": [{"role": "user", "content": "w"}], "prompt": "w", **stream, "stream_options": options}
    with pytest.raises(ApiError) as refused:
        parse_request(body, chat=chat, default_spec=SpecParams())
    assert refused.value.status == 400 and refused.value.param == "stream_options"
    assert refused.value.message == "stream_options can only be set if stream is true"


def test_null_stream_options_without_stream_is_accepted() -> None:
    body = {"messages": [{"role": "user", "content": "w"}], "stream_options": None}
    req = parse_request(body, chat=True, default_spec=SpecParams())
    assert not req.stream and not req.include_usage
    req = parse_request({**body, "stream": True, "stream_options": {}}, chat=True, default_spec=SpecParams())
    assert req.stream and not req.include_usage


@pytest.mark.parametrize("message", [{"role": "robot", "content": "w"}, {"content": "w"}, "w"])
def test_an_unknown_role_is_a_400_listing_every_accepted_role(message) -> None:
    """The message listed system, user, assistant and tool, leaving out developer, which is accepted (as system)."""
    with pytest.raises(ApiError) as refused:
        parse_request({"messages": [{"role": "user", "content": "w"}, message]}, chat=True, default_spec=SpecParams())
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert refused.value.message == "messages[1] needs a role of system, developer, user, assistant or tool"
    body = {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "w"}]}
    assert parse_request(body, chat=True, default_spec=SpecParams()).prompt[0]["role"] == "system"


@pytest.mark.parametrize("field", ["stop", "tools"])
@pytest.mark.parametrize("value", [False, 0, {}, 0.0])
def test_a_falsy_value_of_the_wrong_type_is_a_400_not_absent(field: str, value) -> None:
    """`stop: 0` or `tools: false` were read as absent (`or []`), where every other wrong type is a 400."""
    body = {"messages": [{"role": "user", "content": "w"}], field: value}
    with pytest.raises(ApiError) as refused:
        parse_request(body, chat=True, default_spec=SpecParams())
    assert refused.value.status == 400 and refused.value.param == field


@pytest.mark.parametrize(
    ("field", "value"), [("stop", None), ("stop", ""), ("stop", []), ("tools", None), ("tools", [])]
)
def test_null_or_empty_stop_and_tools_are_none(field: str, value) -> None:
    req = parse_request({"messages": [{"role": "user", "content": "w"}], field: value}, True, SpecParams())
    assert req.sampling.stop == [] and req.tools == []
