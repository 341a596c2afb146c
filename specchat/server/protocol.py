"""The OpenAI chat-completions and completions requests: a JSON body in, a validated GenerationRequest out, and its
messages in the form the model's chat template reads (with_tools). The answers are built in responses.py.

Only what the engine does is accepted: n = 1, no logprobs, JSON mode, penalties, logit bias or legacy functions
(their values that ask for nothing pass: response_format text, penalties of 0, an empty logit_bias, null). OpenAI's
defaults apply where a field is absent (temperature 1, top_p 1, max_tokens up to the context; 16 on /v1/completions).
Speculation can be set per request with two fields beside the standard ones (the `extra_body` of the openai client):
`drafter` and `k` (an integer or "auto"); `ignore_eos` (as vLLM takes it, which benchmark clients send) writes on past
the model's end-of-text tokens up to max_tokens or a stop string.
Errors a client causes are ApiError, which the app answers with OpenAI's error body and a 4xx status.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from specchat.agent.toolcalls import template_renders_tools, tools_system_prompt
from specchat.config import SamplingParams, SpecParams
from specchat.errors import ConfigError

MAX_STOP = 4  # stop strings per request, as OpenAI allows
COMPLETION_TOKENS = 16  # /v1/completions' max_tokens where absent, as OpenAI's and vLLM's (chat's: the context)
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]; a client that sends more gets the same 400 it would get there
ROLES = ("system", "developer", "user", "assistant", "tool")  # a chat message's; developer is read as system


# SamplingParams' messages start with the field's CLI name -> the request's field
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top-p": "top_p",
    "top-k": "top_k",
    "seed": "seed",
    "max-tokens": "max_tokens",
}


class ApiError(Exception):
    """A request the server refuses: status, OpenAI error type, the offending parameter, and any headers its response
    carries (an overloaded server's Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class GenerationRequest:
    """A validated request: what to encode, how to sample and draft, how to answer."""

    chat: bool
    prompt: list[dict] | str | list[int]  # chat messages, or a raw prompt or its token ids (completions)
    sampling: SamplingParams
    spec: SpecParams
    stream: bool = False
    include_usage: bool = False
    tools: list[dict] = field(default_factory=list)
    max_tokens: int | None = None  # None: up to the context (filled in once the prompt is encoded)


def _field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ApiError(400, f"{name} must be a number, got a boolean", name)
    if not isinstance(value, kind):
        raise ApiError(400, f"{name} has the wrong type: {type(value).__name__}", name)
    return value


def _seed(body: dict) -> int | None:
    """The request's seed: any 64-bit integer, as vLLM takes it (some clients send -1); a negative one is read as
    its two's complement, so each still gives its own reproducible text."""
    seed = _field(body, "seed", int)
    if seed is not None and -(1 << 63) <= seed < 0:
        seed += 1 << 64
    return seed


def parse_request(body: Any, chat: bool, default_spec: SpecParams, model_drafter: str = "none") -> GenerationRequest:
    """A JSON body of /v1/chat/completions (chat) or /v1/completions -> GenerationRequest, or ApiError.
    `model_drafter` is what a request's drafter "default" names: the served model's models.toml drafter."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompt = _messages(body.get("messages")) if chat else _prompt(body.get("prompt"))
    if _field(body, "n", int, 1) != 1:
        raise ApiError(400, "only n = 1 is supported", "n")
    logprobs = body.get("logprobs")  # (/v1/completions' logprobs 0 asks for the chosen tokens' own: 0 == False)
    if (logprobs is not None and logprobs is not False) or body.get("top_logprobs") not in (None, 0):
        raise ApiError(400, "logprobs are not supported", "logprobs")
    if not chat:  # what /v1/completions would do differently with them, silently not done, is refused
        if body.get("echo") not in (None, False):
            raise ApiError(400, "echo is not supported", "echo")
        if body.get("suffix") not in (None, ""):
            raise ApiError(400, "suffix is not supported", "suffix")
        if body.get("best_of") not in (None, 1):
            raise ApiError(400, "only best_of = 1 is supported", "best_of")
    _refuse_output_shaping(body)
    limits = {name: _field(body, name, int) for name in ("max_completion_tokens", "max_tokens")}  # the newer first
    for name, limit in limits.items():
        if limit is not None and limit <= 0:  # a 0 is refused, not taken for an absent field
            raise ApiError(400, f"{name} must be > 0, got {limit}", name)
    max_tokens = next((limit for limit in limits.values() if limit is not None), None if chat else COMPLETION_TOKENS)
    stop = body.get("stop")  # None or "" is no stop; 0, false or {} are refused below (they were read as none)
    stop = [] if stop is None or stop == "" else stop
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise ApiError(400, f"stop must be a string or a list of up to {MAX_STOP} non-empty strings", "stop")
    temperature = float(_field(body, "temperature", (int, float), 1.0))
    if not 0.0 <= temperature <= MAX_TEMPERATURE:  # (NaN fails this too)
        raise ApiError(
            400, f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {temperature:g}", "temperature"
        )
    top_p, top_k = float(_field(body, "top_p", (int, float), 1.0)), _field(body, "top_k", int, 0)
    if top_p == 0.0:  # in OpenAI's range (0 to 1): the top token alone, which is greedy
        temperature, top_p = 0.0, 1.0
    if top_k == -1:  # vLLM's "off" (the engine's is 0)
        top_k = 0
    try:
        # (a temperature or top_p so small that float32 takes it for 0, 1e-300, is greedy / keeps the top token:
        # SamplingParams.greedy and sampling.probs_from_logits)
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=_seed(body),
            max_tokens=max_tokens or 1,  # the real cap is set once the prompt's length is known
            stop=stop,
            ignore_eos=bool(_field(body, "ignore_eos", bool, False)),
        )
    except ConfigError as exc:  # SamplingParams names the field first: "top_p must be ..."
        raise ApiError(400, str(exc), SAMPLING_FIELDS.get(str(exc).split(" ", 1)[0])) from None
    stream = bool(_field(body, "stream", bool, False))
    stream_options = _field(body, "stream_options", dict, {})
    if body.get("stream_options") is not None and not stream:  # as OpenAI and vLLM: usage asked of no stream
        raise ApiError(400, "stream_options can only be set if stream is true", "stream_options")
    include_usage = stream_options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):  # ("no" was true)
        raise ApiError(400, "stream_options.include_usage must be a boolean", "stream_options")
    return GenerationRequest(
        chat=chat,
        prompt=prompt,
        sampling=sampling,
        spec=_spec(body, default_spec, model_drafter),
        stream=stream,
        include_usage=include_usage is True,
        tools=_tools(body) if chat else [],
        max_tokens=max_tokens,
    )


def _prompt(prompt: Any) -> str | list[int]:
    """/v1/completions' prompt: a text or token ids, alone or as a batch of one (OpenAI's four forms; the engine checks
    the ids against the vocabulary). A batch of several is refused: it would need a choice for each."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "a batch of prompts is not supported: send one prompt a request", "prompt")
    raise ApiError(400, "prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def _refuse_output_shaping(body: dict) -> None:
    """A 400 naming a field that would shape the output in a way the engine does not (a JSON mode, penalties, biased
    logits, legacy functions), unless its value asks for nothing: clients send penalties of 0, a text
    response_format or an empty logit_bias explicitly. A value of the wrong type is a 400 too."""
    for name in ("presence_penalty", "frequency_penalty"):
        if _field(body, name, (int, float), 0) != 0:  # (NaN too)
            raise ApiError(400, f"only {name} = 0 is supported", name)
    if _field(body, "logit_bias", dict, {}):
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if _field(body, "response_format", dict, {"type": "text"}).get("type") != "text":
        raise ApiError(400, 'only response_format {"type": "text"} is supported (no JSON mode)', "response_format")
    if _field(body, "functions", list, []):
        raise ApiError(400, "functions are not supported: declare tools", "functions")
    if _field(body, "function_call", (str, dict), "none") not in ("none", "auto"):
        raise ApiError(400, 'function_call is not supported: declare tools (tool_choice "auto")', "function_call")


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            roles = f"{', '.join(ROLES[:-1])} or {ROLES[-1]}"
            raise ApiError(400, f"messages[{i}] needs a role of {roles}", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported", "messages")
            if not all(isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"messages[{i}]: a text content part's text must be a string", "messages")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or text parts", "messages")
        role = "system" if message["role"] == "developer" else message["role"]
        entry = {"role": role, "content": content or ""}
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise ApiError(400, f"messages[{i}].tool_calls must be a list of tool calls", "messages")
            entry["tool_calls"] = [_call_for_template(call, i) for call in calls]
        if role == "tool":  # null as absent (clients send it), not the template's text "None"
            for key in ("tool_call_id", "name"):
                value = message.get(key)
                if value is not None and not isinstance(value, str):
                    raise ApiError(400, f"messages[{i}].{key} must be a string", "messages")
                entry[key] = value or ""
        out.append(entry)
    return out


def _call_for_template(call: Any, i: int) -> dict:
    """An OpenAI tool call of messages[i] (arguments as a JSON string) -> the HF chat-template form (arguments as a
    dict), or ApiError where it is not {function: {name, arguments}} with arguments a JSON object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ApiError(400, f"messages[{i}].tool_calls: each needs a function with a name", "messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except (ValueError, RecursionError):  # not JSON, or more than Python decodes (deep, 4,300+ digits)
            arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"messages[{i}].tool_calls: a tool call's arguments must be a JSON object", "messages")
    return {
        "id": str(call.get("id", "")),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools")  # None is no tools; false, 0 or {} are refused below (they were read as none)
    tools = [] if tools is None else tools
    if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
        raise ApiError(
            400,
            "tools must be a list of {type: function, function: {name, description, parameters}}: the name a "
            "non-empty string, the description a string, the parameters a JSON Schema object",
            "tools",
        )
    choice = body.get("tool_choice")
    if choice == "none":
        return []
    if choice not in (None, "auto"):  # "required" or a named function: nothing here would force the call
        raise ApiError(
            400, 'tool_choice must be "auto" or "none" (the model decides whether to call a tool)', "tool_choice"
        )
    return tools


def _is_tool(tool: Any) -> bool:
    """A function tool as OpenAI's is: a name of another type passed, and naming the declared functions at the answer's
    end raised (an object's name is unhashable): a plain-text 500 after the whole answer, or a cut stream."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        return False
    function = tool["function"]
    description, parameters = function.get("description"), function.get("parameters")  # (null: absent)
    return (
        isinstance(function.get("name"), str)
        and bool(function["name"])
        and (description is None or isinstance(description, str))
        and (parameters is None or isinstance(parameters, dict))
    )


def _spec(body: dict, default: SpecParams, model_drafter: str) -> SpecParams:
    drafter = body.get("drafter")  # null is absent, as for every other field (it was a 400)
    drafter = default.drafter if drafter is None else drafter
    k = body.get("k")
    k = ("auto" if default.k is None else default.k) if k is None else k
    if not isinstance(drafter, str):
        raise ApiError(400, "drafter must be a string", "drafter")
    # a file, a folder or a model (bare draft-model: the registry's default one): the server's disk, the hub; also
    # where "default" names one (the model's models.toml drafter), unless the server runs it already
    named = model_drafter if drafter == "default" else drafter
    if (":" in named or named == "draft-model") and default.drafter not in (drafter, named):
        meaning = f" (this model's {named!r})" if named != drafter else ""
        raise ApiError(
            400,
            f"drafter {drafter!r}{meaning}: a request names a built-in drafter (such as ngram, heads or ngram+heads); "
            f"drafters from files, folders or other models are chosen when the server starts (serve --drafter)",
            "drafter",
        )
    if k != "auto" and (not isinstance(k, int) or isinstance(k, bool)):
        raise ApiError(400, 'k must be an integer or "auto"', "k")
    try:
        return SpecParams(drafter=drafter, k=None if k == "auto" else k, k_max=default.k_max)
    except ConfigError as exc:
        raise ApiError(400, str(exc), "k") from None


def with_tools(messages: list[dict], tools: list[dict], chat_template: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for the template): templates that render tools get them as they are; others (SmolLM2's
    ChatML) get them spelled out in the system message, and tool turns as <tool_call> / <tool_response> text. The
    tool turns are spelled out without tools too (tool_choice "none", or a follow-up that drops `tools`): ChatML
    rendered such an assistant turn empty, its call lost, and the result as a "tool" turn the model never saw."""
    if template_renders_tools(chat_template):
        return messages, tools or None
    if not tools and not any(message.get("tool_calls") or message["role"] == "tool" for message in messages):
        return messages, None
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]
            ]
            text = f"{message['content']}<tool_call>{json.dumps(calls)}</tool_call>"
            out.append({"role": "assistant", "content": text})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    if tools and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": tools_system_prompt(out[0]["content"], tools)}
    elif tools:
        out.insert(0, {"role": "system", "content": tools_system_prompt("You are a helpful assistant.", tools)})
    return out, None
