"""Tool-call parsing on the formats real chat templates emit, including broken output."""

import json
import re

from specchat.agent.toolcalls import (
    ToolCall,
    assistant_message,
    feedback_message,
    parse_tool_calls,
    result_text,
    template_renders_tools,
    tool_message,
    tools_system_prompt,
)
from specchat.agent.tools import ToolResult


def hermes(name: str, arguments: dict | str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_hermes_single_call_and_visible_text():
    reply = parse_tool_calls("Let me compute.\n" + hermes("python", {"code": "print(2 + 2)"}))
    assert reply.format == "hermes"
    assert [(c.name, c.arguments) for c in reply.calls] == [("python", {"code": "print(2 + 2)"})]
    assert reply.errors == []
    assert reply.content == "Let me compute."


def test_hermes_several_blocks_keep_order_and_get_distinct_ids():
    text = hermes("read_file", {"path": "a.txt"}) + "\n" + hermes("list_dir", {})
    reply = parse_tool_calls(text, step=3)
    assert [c.name for c in reply.calls] == ["read_file", "list_dir"]
    ids = [c.id for c in reply.calls]
    assert len(set(ids)) == 2
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    assert parse_tool_calls(text, step=4).calls[0].id not in ids


def test_smollm2_list_inside_one_block():
    text = '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>'
    reply = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in reply.calls] == [("a", {"x": 1}), ("b", {})]


def test_empty_list_means_no_call_and_no_error():
    reply = parse_tool_calls("<tool_call>[]</tool_call>")
    assert reply.calls == [] and reply.errors == []


def test_nested_json_with_braces_and_closing_tag_inside_strings():
    code = 'd = {"a": [1, {"b": "}{"}]}\nprint("</tool_call>" if d else "{")'
    arguments = {"code": code, "options": {"deep": {"deeper": [{"x": "]"}]}}}
    text = f"<tool_call>{json.dumps({'name': 'python', 'arguments': arguments})}</tool_call> done"
    reply = parse_tool_calls(text)
    assert reply.errors == []
    assert [(c.name, c.arguments) for c in reply.calls] == [("python", arguments)]
    assert reply.content == "done"


def test_unbalanced_block_does_not_swallow_the_next():
    text = '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>\n' + hermes("b", {"y": 2})
    reply = parse_tool_calls(text)
    assert [c.name for c in reply.calls] == ["b"]
    assert len(reply.errors) == 1


def test_fenced_json_inside_a_block():
    reply = parse_tool_calls('<tool_call>\n```json\n{"name": "a", "arguments": {}}\n```\n</tool_call>')
    assert [c.name for c in reply.calls] == ["a"] and reply.errors == []


def test_truncated_call_is_an_error_not_a_call():
    reply = parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": "for i in ran')
    assert reply.calls == []
    assert len(reply.errors) == 1
    assert "cut off" in reply.errors[0]
    assert "<tool_call>" in reply.errors[0]  # the hint shows the expected format


def test_unclosed_block_with_whole_json_is_accepted():
    reply = parse_tool_calls('<tool_call>{"name": "final_answer", "arguments": {"answer": "391"}}')
    assert [(c.name, c.arguments) for c in reply.calls] == [("final_answer", {"answer": "391"})]
    assert reply.errors == []


def test_malformed_json_is_an_error_and_other_calls_survive():
    text = '<tool_call>{"name": "a" "arguments": {}}</tool_call>' + hermes("b", {"y": 2})
    reply = parse_tool_calls(text)
    assert [c.name for c in reply.calls] == ["b"]
    assert len(reply.errors) == 1 and "invalid JSON" in reply.errors[0]


def test_python_literal_dict_is_accepted():
    reply = parse_tool_calls("<tool_call>{'name': 'python', 'arguments': {'code': 'x = True'}}</tool_call>")
    assert reply.calls[0].arguments == {"code": "x = True"}


def test_missing_name_and_non_object_arguments_are_errors():
    reply = parse_tool_calls(
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "a", "arguments": 3}</tool_call>'
    )
    assert reply.calls == []
    assert len(reply.errors) == 2
    assert '"name"' in reply.errors[0]
    assert "JSON object" in reply.errors[1]


def test_arguments_given_as_a_json_string_are_decoded():
    reply = parse_tool_calls(hermes("a", {}).replace("{}", '"{\\"x\\": [1, 2]}"'))
    assert reply.calls[0].arguments == {"x": [1, 2]}


def test_think_blocks_are_not_acted_on():
    reply = parse_tool_calls("<think>maybe " + hermes("python", {"code": "1"}) + "</think>The answer is 4.")
    assert reply.calls == [] and reply.content == "The answer is 4."


def test_llama_python_tag_json_with_parameters():
    reply = parse_tool_calls('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>')
    assert reply.format == "llama"
    assert [(c.name, c.arguments) for c in reply.calls] == [("get_weather", {"city": "Paris"})]


def test_llama_several_calls_separated_by_semicolons():
    text = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 1}}'
    assert [c.name for c in parse_tool_calls(text).calls] == ["a", "b"]


def test_llama_raw_code_after_python_tag_is_a_python_call():
    reply = parse_tool_calls("<|python_tag|>print(17 * 23)<|eom_id|>")
    assert [(c.name, c.arguments) for c in reply.calls] == [("python", {"code": "print(17 * 23)"})]


def test_llama_truncated_after_python_tag():
    reply = parse_tool_calls('<|python_tag|>{"name": "a", "parameters": {"q": "x')
    assert reply.calls == [] and "cut off" in reply.errors[0]


def test_llama_json_without_tag_uses_the_fallback():
    reply = parse_tool_calls('{"name": "search", "parameters": {"query": "specchat"}}')
    assert reply.format == "json"
    assert [(c.name, c.arguments) for c in reply.calls] == [("search", {"query": "specchat"})]


def test_plain_json_in_a_fence_inside_prose():
    call = '{"name": "read_file", "arguments": {"path": "notes.txt"}}'
    text = f"I will read it.\n```json\n{call}\n```\nThen answer."
    reply = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in reply.calls] == [("read_file", {"path": "notes.txt"})]
    assert "```" not in reply.content
    assert "I will read it." in reply.content and "Then answer." in reply.content


def test_a_bare_list_of_calls_leaves_no_brackets_in_the_content():
    text = 'Both: [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"a": [1]}}] then done'
    reply = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in reply.calls] == [("f", {}), ("g", {"a": [1]})]
    assert reply.content == "Both:  then done" and not reply.errors
    other = parse_tool_calls('a list [1, 2] and {"name": "f", "arguments": {}}')  # a list of other things stays
    assert other.content == "a list [1, 2] and" and [c.name for c in other.calls] == ["f"]


def test_openai_function_wrapper():
    text = '{"type": "function", "function": {"name": "f", "arguments": "{\\"a\\": 1}"}}'
    assert [(c.name, c.arguments) for c in parse_tool_calls(text).calls] == [("f", {"a": 1})]


def test_json_that_is_not_a_call_is_left_alone():
    reply = parse_tool_calls('The config is {"name": "Bob", "age": 3} and {not json}.')
    assert reply.calls == [] and reply.errors == [] and reply.format is None
    assert reply.content == 'The config is {"name": "Bob", "age": 3} and {not json}.'


def test_truncated_plain_json_call_is_an_error():
    reply = parse_tool_calls('Sure: {"name": "read_file", "arguments": {"path": "no')
    assert reply.calls == [] and "cut off" in reply.errors[0]


def test_plain_text_has_no_calls():
    reply = parse_tool_calls("The answer is 391.")
    assert reply.calls == [] and reply.errors == [] and reply.content == "The answer is 391."


def test_messages_for_templates_that_render_tool_calls():
    call = ToolCall("c00010000", "python", {"code": "print(1)"})
    parsed = parse_tool_calls("Running it. " + hermes("python", {"code": "print(1)"}), step=1)
    message = assistant_message("raw", parsed, structured=True)
    assert message["content"] == "Running it."
    assert message["tool_calls"] == [
        {
            "id": "c00010000",
            "type": "function",
            "function": {"name": "python", "arguments": {"code": "print(1)"}},
        }
    ]
    result = tool_message(call, ToolResult(True, "1\n"), structured=True)
    assert result == {"role": "tool", "tool_call_id": "c00010000", "name": "python", "content": "1\n"}


def test_messages_for_templates_that_do_not():
    raw = hermes("python", {"code": "print(1)"})
    assert assistant_message(raw, parse_tool_calls(raw), structured=False) == {
        "role": "assistant",
        "content": raw,
    }
    call = ToolCall("c00010000", "python", {})
    message = tool_message(call, ToolResult(False, "Traceback...", "exited with status 1"), structured=False)
    assert message["role"] == "user"
    assert message["content"].startswith("<tool_response>\nError: exited with status 1\nTraceback...")
    assert feedback_message(["a", "b"]) == {"role": "user", "content": "a\nb"}


def test_result_text():
    assert result_text(ToolResult(True, "391")) == "391"
    assert result_text(ToolResult(False, "", "timed out")) == "Error: timed out"


def test_tools_system_prompt_lists_tools_and_its_example_parses():
    schema = {
        "type": "function",
        "function": {"name": "python", "description": "Run code.", "parameters": {}},
    }
    prompt = tools_system_prompt("Be brief.", [schema])
    assert prompt.startswith("Be brief.")
    assert '"name": "python"' in prompt
    example = next(line for line in prompt.splitlines() if line.startswith("<tool_call>"))
    assert [c.name for c in parse_tool_calls(example).calls] == ["func_name"]


def test_template_renders_tools():
    assert template_renders_tools("{% if tools %}...{% for c in message.tool_calls %}")
    assert not template_renders_tools("{% for message in messages %}<|im_start|>{{ message.content }}")


def test_a_lone_surrogate_escape_becomes_valid_text():
    """JSON's "\\ud800" decodes to a lone surrogate: the trace could not write the call (a traceback that ended every
    run), nor a prompt or a file name hold it."""
    reply = parse_tool_calls('<tool_call>{"name": "write_file", "arguments": {"path": "a\\ud800.txt", '
                             '"content": ["x\\udc80", {"k\\ud800": "\\ud83d\\ude00"}]}}</tool_call>')  # fmt: skip
    [call] = reply.calls
    assert call.arguments == {"path": "a\\ud800.txt", "content": ["x\\udc80", {"k\\ud800": "\U0001f600"}]}
    json.dumps(call.arguments, ensure_ascii=False).encode("utf-8")  # encodes: the trace and the prompt can hold it


def test_a_python_literal_call_holds_only_json_values():
    """A Python-literal call with bytes, a set or a complex number passed as a call, and the trace's JSON of it raised
    TypeError in the run's thread (a traceback that ended every run); a tuple is a JSON array."""
    reply = parse_tool_calls("<tool_call>{'name': 'python', 'arguments': {'code': b'print(1)'}}</tool_call>")
    assert reply.calls == [] and reply.errors[0].startswith("tool call could not be parsed: invalid JSON")
    for value in ("{1, 2}", "1j"):
        assert parse_tool_calls(f"{{'name': 'f', 'arguments': {{'x': {value}}}}}").errors
    reply = parse_tool_calls("<tool_call>{'name': 'f', 'arguments': {'x': (1, 'a'), 2: None}}</tool_call>")
    assert [call.arguments for call in reply.calls] == [{"x": [1, "a"], "2": None}]


def test_nan_and_infinity_in_arguments_are_an_error_not_a_call():
    """json.loads takes NaN and Infinity: the call's event then wrote `NaN` into the JSONL trace, which strict JSON
    parsers (jq, JSON.parse) refuse."""
    reply = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": [1, {"y": -Infinity}]}}</tool_call>')
    assert reply.calls == [] and "hold NaN or Infinity" in reply.errors[0]
    assert parse_tool_calls('{"name": "f", "arguments": "{\\"x\\": NaN}"}').errors  # arguments as a JSON string
    assert parse_tool_calls('{"name": "f", "arguments": {"x": 1e308}}').calls  # large, but a number


def test_json_past_what_python_decodes_is_an_error_not_a_crash():
    """A number of more than 4300 digits (Python's int limit) or nesting past the interpreter's stack raised
    ValueError / RecursionError out of the parser: a traceback in the run's thread that ended every run."""
    digits = "1" * 5000
    deep = '{"a": ' * 2000 + "1" + "}" * 2000
    for reply in (
        f'<tool_call>{{"name": "python", "arguments": {{"code": {digits}}}}}</tool_call>',
        f'<tool_call>{{"name": "python", "arguments": {{"code": {digits}',  # cut off at the token limit
        f'{{"name": "python", "arguments": {{"code": {digits}}}}}',
        hermes("python", f'{{"code": {digits}}}'),  # arguments as a JSON string
    ):
        parsed = parse_tool_calls(reply)
        assert parsed.calls == [] and "a number of more than 4300 digits" in parsed.errors[0]
    for reply in (
        f'<tool_call>{{"name": "python", "arguments": {deep}}}</tool_call>',
        "<tool_call>" + "[" * 100_000 + "</tool_call>",
        hermes("python", deep),  # arguments as a JSON string
    ):
        parsed = parse_tool_calls(reply)
        assert parsed.calls == [] and "nested too deeply" in parsed.errors[0]
    shallower = '{"a": ' * 600 + "1" + "}" * 600  # decodes, then is too deep to walk
    parsed = parse_tool_calls(
        hermes("python", {}) + f'<tool_call>{{"name": "f", "arguments": {shallower}}}</tool_call>'
    )
    assert [call.name for call in parsed.calls] == ["python"]
    assert parsed.errors[0].startswith("the arguments of f hold arrays and objects nested too deeply")
    assert parse_tool_calls(f'The digits: {{"x": {digits}}}').errors == []  # not a call: left alone, as before
