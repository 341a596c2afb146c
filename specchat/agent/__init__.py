"""Scripted agent loops: the script format, tools and their sandbox, tool-call parsing, trace events."""

from specchat.agent.script import AgentScript, StopCondition, load_script
from specchat.agent.toolcalls import ParsedReply, ToolCall, parse_tool_calls
from specchat.agent.tools import Tool, Toolbox, ToolOptions, ToolResult, ToolsConfig, build_toolbox
from specchat.agent.usertools import tool

__all__ = [
    "AgentScript",
    "ParsedReply",
    "StopCondition",
    "Tool",
    "ToolCall",
    "ToolOptions",
    "ToolResult",
    "Toolbox",
    "ToolsConfig",
    "build_toolbox",
    "load_script",
    "parse_tool_calls",
    "tool",
]
