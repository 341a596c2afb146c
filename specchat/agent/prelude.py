"""What every python tool process runs first: Python-level guards, then the model's code from stdin, REPL-style.

Run as `python -I -X utf8 -c <this file's text>` (specchat/agent/processes.py), standalone, never imported. The
guards are an audit hook (PEP 578), which code in the process cannot remove: it refuses creating any socket but
an AF_UNIX one, resolving names, and opening another process's /proc/PID/environ. They bind this interpreter
only: a child process it starts, or C code it calls through ctypes, is not audited. The kernel-level walls (the
namespaces, limits and cgroup around the process) are set up before it starts.
"""

import ast
import linecache
import os
import re
import socket
import sys
import traceback

NETWORK_EVENTS = frozenset({"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"})
ENVIRON_PATH = re.compile(r"/proc/(\d+)(?:/task/\d+)?/environ")


def audit(event: str, args: tuple) -> None:
    """Refuse network use and reading other processes' environments; every other event passes."""
    if event in NETWORK_EVENTS or (event == "socket.__new__" and args[1] != socket.AF_UNIX):
        raise PermissionError("network access is disabled in the specchat python tool")
    if event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        match = ENVIRON_PATH.fullmatch(os.path.realpath(os.fsdecode(args[0])))
        if match is not None and int(match.group(1)) != os.getpid():
            raise PermissionError("reading another process's environment is disabled in the specchat python tool")


def run(source: str) -> None:
    """Execute `source` as the module `__main__`; print the value of a final expression, as a REPL does."""
    linecache.cache["<agent>"] = (len(source), None, source.splitlines(True), "<agent>")
    namespace = {"__name__": "__main__"}
    try:
        tree = ast.parse(source, "<agent>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<agent>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<agent>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except BaseException as error:
        frames = None if isinstance(error, SyntaxError) else error.__traceback__.tb_next
        traceback.print_exception(type(error), error, frames)
        sys.exit(1)


def main() -> None:
    sys.addaudithook(audit)
    sys.path.insert(0, os.getcwd())
    source = sys.stdin.read()
    sys.stdin = open(os.devnull)  # noqa: SIM115 -- the code's stdin, open for the life of the process
    run(source)


if __name__ == "__main__":
    main()
