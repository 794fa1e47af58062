"""The coding-agent tools of the synthetic traces, computing real output over a `Workspace`.

Each function returns the text a CLI coding agent's tool would return: file contents with line
numbers, regex matches found in the tree, listings of its files, and the output of real commands
(`python -m tokenize`, `python -m ast`, an `ast.parse` syntax check) run by the running interpreter.
Nothing here decides *which* tool to call; that is `_agent_sessions`.
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import lru_cache

from ._source_tree import Workspace, interpreter

MAX_LINE_CHARS = 2000  # longer lines are cut, as coding agents' read tools do

CHECK_SCRIPT = "import ast, sys; ast.parse(sys.stdin.read()); print('syntax ok')"


def numbered(lines: list[str], first: int) -> list[str]:
    """`cat -n` style lines (6-wide number, tab, text), long lines cut at MAX_LINE_CHARS."""
    out = []
    for i, line in enumerate(lines, first):
        if len(line) > MAX_LINE_CHARS:
            line = line[:MAX_LINE_CHARS] + "... [line truncated]"
        out.append(f"{i:6d}\t{line}")
    return out


def read_lines(ws: Workspace, path: str, offset: int, limit: int) -> list[str]:
    """Numbered lines offset..offset+limit-1 (1-based) of `path` as the workspace holds it."""
    lines = ws.text(path).splitlines()
    return numbered(lines[offset - 1 : offset - 1 + limit], offset)


def grep_lines(ws: Workspace, pattern: str, path: str) -> list[str]:
    """Every `file:line:text` match of regex `pattern` in files under `path`, sorted by file."""
    rx = re.compile(pattern, re.MULTILINE)
    out = []
    for rel in ws.tree.files_under(path):
        text = ws.text(rel)
        last_line_start = -1
        for m in rx.finditer(text):
            start = text.rfind("\n", 0, m.start()) + 1
            if start == last_line_start:
                continue  # one output line per matching source line, like grep
            last_line_start = start
            end = text.find("\n", m.start())
            line = text[start : end if end >= 0 else len(text)]
            if len(line) > MAX_LINE_CHARS:
                line = line[:MAX_LINE_CHARS] + "... [line truncated]"
            out.append(f"{rel}:{text.count(chr(10), 0, start) + 1}:{line}")
    return out


def grep_files(ws: Workspace, pattern: str, path: str) -> list[str]:
    """Files under `path` with at least one match of regex `pattern`, sorted."""
    rx = re.compile(pattern, re.MULTILINE)
    return [rel for rel in ws.tree.files_under(path) if rx.search(ws.text(rel))]


def glob_files(ws: Workspace, pattern: str) -> list[str]:
    """Files matching a glob with `*`, `?` and `**/` (any directories), sorted."""
    rx = re.compile(_glob_regex(pattern))
    return [rel for rel in ws.tree.files if rx.fullmatch(rel)]


def _glob_regex(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def listing_lines(ws: Workspace, path: str) -> list[str]:
    """An indented tree (`- name/`, `- file.py`) of the used files under directory `path`."""
    base = path.rstrip("/")
    out = [f"- {base or '.'}/"]
    seen_dirs: set[str] = set()
    for rel in ws.tree.files_under(base):
        parts = rel[len(base) + 1 :].split("/") if base else rel.split("/")
        for depth in range(len(parts) - 1):
            d = "/".join(parts[: depth + 1])
            if d not in seen_dirs:
                seen_dirs.add(d)
                out.append("  " * (depth + 1) + f"- {parts[depth]}/")
        out.append("  " * len(parts) + f"- {parts[-1]}")
    return out


def run_python(ws: Workspace, args: tuple[str, ...], stdin_path: str) -> list[str]:
    """Output lines (stdout then stderr, then `Exit code N` if non-zero) of the running Python
    started isolated (-I) in the tree root with `args`, the workspace text of `stdin_path` on stdin.
    """
    return list(_run_cached(ws.tree.root.as_posix(), args, ws.text(stdin_path)))


@lru_cache(maxsize=64)
def _run_cached(cwd: str, args: tuple[str, ...], stdin_text: str) -> tuple[str, ...]:
    # A fixed, minimal environment: the output must not depend on who runs the build.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [interpreter(), "-I", *args],
        input=stdin_text.encode(),
        capture_output=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )
    text = proc.stdout.decode("utf-8", "replace") + proc.stderr.decode("utf-8", "replace")
    lines = text.splitlines()
    if proc.returncode != 0:
        lines.append(f"Exit code {proc.returncode}")
    return tuple(lines)


def edit_result(ws: Workspace, path: str, start_line: int, n_new_lines: int) -> str:
    """The confirmation an editor tool returns: a numbered snippet around the edited lines."""
    lines = ws.text(path).splitlines()
    a = max(1, start_line - 4)
    b = min(len(lines), start_line + n_new_lines - 1 + 4)
    snippet = "\n".join(numbered(lines[a - 1 : b], a))
    return (
        f"The file {path} has been updated. Here's the result of running `cat -n` on a snippet "
        f"of the edited file:\n{snippet}"
    )
