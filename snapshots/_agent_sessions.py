"""Synthetic coding-agent sessions over a real source tree: what the agent does, turn by turn.

A session is: a system prompt (agent instructions, tools, environment, project layout), a user
task generated from templates over a real file of the tree, then turns of
``assistant text, tool_call x m, tool_result x m`` and a final assistant summary. Tool results are
real (`_agent_tools`). This module *decides*: which task, which tool, how large each turn is.

Sizing: request k of a session (the context before its k-th assistant message) aims at
``T_k = t0 + (L - t0) * (k / (R - 1)) ** g`` tokens, where t0 is the first request, L the session's
final length and g its growth exponent; each turn is fitted to the gap between the running context
and the next target (never above it when the tool's output can shrink), so errors do not accumulate.
"""

from __future__ import annotations

import ast
import math
import platform
import re
import random
import sys
from dataclasses import dataclass, field
from typing import Callable

from . import chat
from . import tokenizer as tk
from ._agent_tools import (
    CHECK_SCRIPT,
    edit_result,
    glob_files,
    grep_files,
    grep_lines,
    listing_lines,
    read_lines,
    run_python,
)
from ._source_tree import FunctionInfo, SourceTree, Workspace

MAX_READ_LINES = 2000  # one read call returns at most this many lines, as agents' read tools do
MAX_PARALLEL_CALLS = 4  # tool calls an assistant message may issue at once
MIN_TURN_TOKENS = 150  # the smallest gap a turn is fitted to (a call, a short result, a sentence)

SYSTEM_PROMPT = """\
You are a coding agent working in a terminal, inside the user's repository. You help with software \
engineering tasks: fixing bugs, adding features, refactoring, explaining code, and reviewing changes. \
Use the tools below to inspect and change the code; never guess at file contents you have not read.

# How to work
- Start by understanding the relevant code: list directories, search for symbols, and read the \
files involved before you change anything.
- Prefer small, focused edits that keep the existing style of the file (naming, comments, \
formatting, imports). Do not add new dependencies.
- After an edit, check that the file still parses and, when tests exist, run the ones that cover \
your change.
- Keep your messages short. Say what you are about to do in one sentence, then call a tool. When \
you are done, summarise what you changed and why, with file paths and line numbers.
- If the task is ambiguous, state the assumption you made instead of stopping.
- Never run commands that modify files outside the repository, access the network, or delete data.

# Tools
Call a tool by writing its name followed by a JSON object of arguments, for example \
Read({"file_path": "pkg/module.py"}). Several independent calls may be issued at once.

Read(file_path, offset?, limit?): returns the file with line numbers (`cat -n` format), at most \
2000 lines per call; long lines are truncated. Use offset/limit to page through large files.
Grep(pattern, path?, output_mode?, head_limit?): searches file contents with a regular \
expression. output_mode "content" shows matching lines as path:line:text, "files_with_matches" \
lists matching files. head_limit keeps the first N results.
Glob(pattern): lists files matching a glob pattern such as "pkg/**/*.py", sorted by path.
LS(path): lists the files and directories under a path as an indented tree.
Bash(command, description): runs a shell command in the repository root and returns its \
output. Use it for syntax checks, running Python tools and tests; avoid interactive commands.
Edit(file_path, old_string, new_string): replaces one exact, unique occurrence of old_string \
with new_string. Read the file first; include enough context to make old_string unique.

# Style of answers
Use Markdown sparingly. Refer to code as `path:line`. Do not paste whole files back to the user."""

TASKS = {
    "fix_none": (
        "Fix the bug in `{mod}.{qual}`: calling it with `{param}=None` fails with an unhelpful "
        "error deep inside. Make it raise a clear `TypeError` instead, and check that its callers "
        "never pass None on purpose."
    ),
    "type_hints": (
        "Add type hints to module `{mod}` ({path}). Start with the functions that return nothing "
        "(they should be annotated `-> None`), and make sure the module still parses afterwards."
    ),
    "docstrings": (
        "Several functions in `{mod}` have no docstring, for example `{qual}`. Add short "
        "one-line docstrings to them, matching the style of the rest of the file."
    ),
    "explain": (
        "Explain how `{mod}.{qual}` works and where it is called from in this repository. "
        "Don't change any code yet; I want to understand it first."
    ),
    "callers": (
        "Find every caller of `{name}` (defined in {path}) and check that they handle its "
        "result correctly. Add a None guard to `{qual}` if any caller can pass None."
    ),
    "perf": (
        "`{mod}.{qual}` seems slow on large inputs. Read the code around it, look at how it is "
        "used, and propose a fix. Keep the public behaviour identical."
    ),
}
EDITS_BY_TASK = {
    "fix_none": ("guard", 3),
    "type_hints": ("annotate", 8),
    "docstrings": ("docstring", 6),
    "explain": (None, 0),
    "callers": ("guard", 2),
    "perf": (None, 0),
}


def module_name(rel: str) -> str:
    """Dotted module name of a relative path ("json/__init__.py" -> "json")."""
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def session_targets(n_sessions: int, shortest: int, longest: int, spacing: float) -> list[int]:
    """Final context length of each session: from `shortest` to `longest`, spaced in log space
    with exponent `spacing` (< 1 puts more sessions near the long end), ascending."""
    if n_sessions == 1:
        return [longest]
    lo, hi = math.log(shortest), math.log(longest)
    return [round(math.exp(lo + (hi - lo) * (i / (n_sessions - 1)) ** spacing)) for i in range(n_sessions)]


@dataclass
class Turn:
    """One agent turn: its assistant text, tool calls (name, input) and their results."""

    text: str
    calls: list[tuple[str, dict]]
    results: list[str]
    on_commit: Callable[[], None] | None = None  # state changes applied only if the turn is kept

    def messages(self) -> list[dict]:
        out = [{"role": "assistant", "content": self.text}]
        out += [{"role": "tool_call", "content": chat.tool_call_content(n, i)} for n, i in self.calls]
        out += [{"role": "tool_result", "content": r} for r in self.results]
        return out


@dataclass
class PlannedEdit:
    path: str
    fn: FunctionInfo
    kind: str
    old: str
    new: str
    description: str


@dataclass
class SessionBuilder:
    """Builds one session's messages; `build()` returns (messages, request prefix lengths)."""

    tree: SourceTree
    rng: random.Random
    requests: int
    min_tokens: int
    final_tokens: int
    growth: float
    progress: Callable[[], None] = lambda: None
    avoid: tuple[str, ...] = ()  # focus files of earlier sessions (variety across the corpus)
    ws: Workspace = field(init=False)
    messages: list[dict] = field(default_factory=list)
    context: int = 0  # tokens of render(messages) + generation prompt

    def __post_init__(self):
        self.ws = Workspace(self.tree)
        self.cursors: dict[str, int] = {}  # next line to read per file
        self.read_queue: list[str] = []
        self.backlog: list[str] = []
        self.read_done: list[str] = []
        self.grep_done: list[tuple[str, str]] = []
        self.edits: list[PlannedEdit] = []
        self.edits_done: list[PlannedEdit] = []
        self.pending_check: str | None = None
        self.commands_done: list[tuple[str, str]] = []
        self.listed: list[str] = []
        self.globs_done: list[str] = []
        self._line_tokens: dict[tuple, list[int]] = {}

    # ---- token accounting -------------------------------------------------------------------
    def count(self, text: str) -> int:
        return len(tk.encode(text))

    def turn_tokens(self, turn: Turn) -> int:
        lens = tk.encode_batch([m["content"] for m in turn.messages()])
        return sum(chat.message_tokens(len(x)) for x in lens)

    def line_tokens(self, key: tuple, lines: list[str]) -> list[int]:
        """Token count of each line plus its newline, cached under `key` (an estimate of joins)."""
        if key not in self._line_tokens:
            self._line_tokens[key] = [len(x) + 1 for x in tk.encode_batch(lines)] if lines else []
        return self._line_tokens[key]

    # ---- the session ------------------------------------------------------------------------
    def build(self) -> tuple[list[dict], list[int]]:
        focus, fn, kind = self._choose_task()
        self.focus, self.focus_fn, self.kind = focus, fn, kind
        self.focus_dir = focus.rsplit("/", 1)[0] if "/" in focus else ""
        self._plan_edits(kind)
        self._init_read_queue()
        user = TASKS[kind].format(
            mod=module_name(focus), qual=fn.qualname, name=fn.name, param=fn.first_param or "value",
            path=focus,
        )
        system = self._system_prompt(user)
        self._append([{"role": "system", "content": system}, {"role": "user", "content": user}])
        t0 = self.context
        prefixes = [len(self.messages)]
        self.progress()
        span = self.requests - 1
        for k in range(span):
            target = t0 + (self.final_tokens - t0) * ((k + 1) / span) ** self.growth
            turn = self._next_turn(k, int(target) - self.context, last=k == span - 1)
            if turn.on_commit:
                turn.on_commit()
            self._append(turn.messages())
            prefixes.append(len(self.messages))
            self.progress()
        self.messages.append({"role": "assistant", "content": self._summary()})
        return self.messages, prefixes

    def _append(self, msgs: list[dict]) -> None:
        lens = tk.encode_batch([m["content"] for m in msgs])
        if not self.messages:
            self.context = 2  # <|bos|> and the generation prompt
        self.messages.extend(msgs)
        self.context += sum(chat.message_tokens(len(x)) for x in lens)

    # ---- task and environment ---------------------------------------------------------------
    def _choose_task(self) -> tuple[str, FunctionInfo, str]:
        kinds = sorted(TASKS)
        candidates = [f for f in self.tree.files if len(self.tree.texts[f]) >= 2000]
        candidates = [f for f in candidates if f not in self.avoid] or candidates or list(self.tree.files)
        for _ in range(200):
            path = self.rng.choice(candidates)
            fns = [f for f in self.tree.functions(path) if not f.name.startswith("__")]
            if len(fns) >= 2:
                kind = self.rng.choice(kinds)
                edit_kind, _ = EDITS_BY_TASK[kind]
                usable = [f for f in fns if self._edit_for(path, f, edit_kind) is not None] if edit_kind else fns
                if usable:
                    return path, self.rng.choice(usable), kind
        for path in self.tree.files:  # a tiny tree: take the first file with any function
            fns = self.tree.functions(path)
            if fns:
                return path, fns[0], "explain"
        raise ValueError(f"no Python functions found under {self.tree.root}")

    def _system_prompt(self, user: str) -> str:
        env = (
            f"\n\n<env>\nWorking directory: {self.tree.root.name}\nPlatform: {sys.platform}\n"
            f"Python: {platform.python_version()}\n</env>\n\n<project_layout>\n"
        )
        entries = self._top_level_entries()
        fixed = 1 + chat.message_tokens(self.count(user)) + 1 + 2
        base = SYSTEM_PROMPT + env
        shown: list[str] = []
        # The layout is trimmed so the first request is about min_tokens long.
        tokens = self.count(base) + fixed
        for e in entries:
            if tokens >= self.min_tokens:
                break
            shown.append(e)
            tokens += self.count(e + "\n")
        more = len(entries) - len(shown)
        tail = f"... ({more} more entries)\n" if more else ""
        return base + "".join(s + "\n" for s in shown) + tail + "</project_layout>"

    def _top_level_entries(self) -> list[str]:
        out, seen = [], set()
        for rel in self.tree.files:
            head = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
            if head not in seen:
                seen.add(head)
                out.append(head)
        return out

    # ---- edits ------------------------------------------------------------------------------
    def _edit_for(self, path: str, fn: FunctionInfo, kind: str | None) -> PlannedEdit | None:
        lines = self.tree.texts[path].splitlines()
        if kind == "annotate":
            line = fn.def_line
            if fn.annotated or fn.returns_value or not line.rstrip().endswith("):"):
                return None
            stripped = line.rstrip()
            old, new = line, stripped[:-2] + ") -> None:"
            desc = f"annotated `{fn.qualname}` with `-> None`"
        elif kind == "guard":
            if not fn.first_param or fn.body_lineno <= fn.lineno:
                return None
            old = "\n".join(lines[fn.lineno - 1 : fn.body_lineno - 1])
            p, ind = fn.first_param, fn.body_indent
            new = f'{old}\n{ind}if {p} is None:\n{ind}    raise TypeError("{p} must not be None")'
            desc = f"`{fn.qualname}` now raises TypeError when `{p}` is None"
        elif kind == "docstring":
            if fn.has_docstring or fn.body_lineno <= fn.lineno:
                return None
            old = "\n".join(lines[fn.lineno - 1 : fn.body_lineno - 1])
            words = " ".join(w for w in fn.name.strip("_").split("_") if w) or fn.name
            new = f'{old}\n{fn.body_indent}"""{words[0].upper() + words[1:]}."""'
            desc = f"added a docstring to `{fn.qualname}`"
        else:
            return None
        if not old.strip() or self.tree.texts[path].count(old) != 1:
            return None
        return PlannedEdit(path, fn, kind, old, new, desc)

    def _plan_edits(self, kind: str) -> None:
        edit_kind, n = EDITS_BY_TASK[kind]
        if not edit_kind:
            return
        first = self._edit_for(self.focus, self.focus_fn, edit_kind)
        others = [self._edit_for(self.focus, f, edit_kind) for f in self.tree.functions(self.focus)]
        others = [e for e in others if e is not None and e.fn != self.focus_fn]
        self.rng.shuffle(others)
        self.edits = ([first] if first else []) + others[: n - 1]

    # ---- choosing a turn --------------------------------------------------------------------
    def _next_turn(self, k: int, budget: int, last: bool = False) -> Turn:
        """The turn for this gap: tools are tried in a weighted random order, each making its
        largest output that fits; an edit or check that fits, or the first candidate filling at least
        40% of a large gap, wins (else the fullest). If nothing fits (a gap smaller than any turn),
        the smallest turn available."""
        # A gap smaller than a useful turn is widened; later gaps shrink to absorb the excess.
        budget = max(budget, MIN_TURN_TOKENS)
        options: list[tuple[float, Callable[[int], Turn | None]]] = []
        if self.pending_check:
            options.append((8.0, self._check_turn))
        elif self.edits and self.focus in self.read_done and self.rng.random() < 0.3:
            options.append((8.0, self._edit_turn))
        if k == 0:
            options.append((6.0, self._ls_turn))
        options += [
            (50.0 if last else 5.0 if budget > 600 else 2.0, self._read_turn),
            (2.0, self._grep_turn),
            (1.0, self._glob_turn),
            (1.0 if budget > 300 else 0.2, self._tokenize_turn),
            (0.7 if budget > 300 else 0.1, self._ast_turn),
            (0.5, self._ls_turn),
        ]
        tried: set[int] = set()
        best: tuple[int, Turn] | None = None
        while len(tried) < len(options):
            weights = [0.0 if i in tried else w for i, (w, _) in enumerate(options)]
            i = self.rng.choices(range(len(options)), weights=weights)[0]
            tried.add(i)
            turn = options[i][1](budget)
            if turn is None:
                continue
            size = self.turn_tokens(turn)
            if size > budget:
                continue
            # Edits and their checks are the task itself: taken whenever they fit.
            if options[i][1] in (self._edit_turn, self._check_turn) or budget < 1500 or size >= 0.4 * budget:
                return turn
            if best is None or size > best[0]:
                best = (size, turn)
        if best is not None:
            return best[1]
        # Nothing fits: take the smallest turn any tool can make.
        smallest = [t for t in (self._check_turn(0, force=True), self._glob_turn(0, force=True)) if t]
        return min(smallest, key=self.turn_tokens)

    def _fit(self, make: Callable[[int], Turn], n_max: int, est: list[int], budget: int) -> Turn | None:
        """Largest n <= n_max whose turn fits `budget` (estimate from per-item tokens `est`, then
        exact check and shrink); None if even n=1 does not fit."""
        if n_max <= 0:
            return None
        base = self.turn_tokens(make(0))  # the turn without output lines
        room, n = budget - base, 0
        for t in est[:n_max]:
            if room - t < 0:
                break
            room -= t
            n += 1
        n = max(n, 1)
        for _ in range(12):
            turn = make(n)
            size = self.turn_tokens(turn)
            if size <= budget:
                return turn
            if n == 1:
                return None
            n = max(1, min(n - 1, int(n * budget / size)))
        return None

    # ---- tools ------------------------------------------------------------------------------
    def _init_read_queue(self) -> None:
        """Reading order, most related first: the focus file, its directory, the modules it
        imports, the modules importing it, its top-level package, then the rest of the tree."""
        same_dir = [f for f in self.tree.files_under(self.focus_dir) if f != self.focus]
        if not self.focus_dir:
            same_dir = [f for f in same_dir if "/" not in f]
        self.rng.shuffle(same_dir)
        mod = module_name(self.focus)
        importers = grep_files(self.ws, rf"^\s*(from {re.escape(mod)} import|import {re.escape(mod)}\b)", "")
        top = self.focus.split("/", 1)[0] + "/" if "/" in self.focus else None
        package = [f for f in self.tree.files if top and f.startswith(top)]
        rest = list(self.tree.files)
        self.rng.shuffle(package)
        self.rng.shuffle(rest)
        order = [self.focus] + same_dir[:6] + self._imported_files() + importers[:8] + same_dir[6:] + package + rest
        seen: set[str] = set()
        self.backlog = [f for f in order if not (f in seen or seen.add(f))]
        self.read_queue = self.backlog[:MAX_PARALLEL_CALLS * 2]
        self.backlog = self.backlog[len(self.read_queue):]

    def _imported_files(self) -> list[str]:
        """Files of the tree that the focus file imports (absolute and relative imports)."""
        try:
            tree = ast.parse(self.tree.texts[self.focus])
        except (SyntaxError, ValueError):
            return []
        package = module_name(self.focus) if self.focus.endswith("__init__.py") else module_name(self.focus).rpartition(".")[0]
        names = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".") if package else []
                    parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                    base = ".".join(p for p in parts + ([base] if base else []) if p)
                names.append(base)
                names += [f"{base}.{a.name}" for a in node.names]
        out = []
        for n in names:
            for cand in (n.replace(".", "/") + ".py", n.replace(".", "/") + "/__init__.py"):
                if cand in self.tree.texts and cand != self.focus and cand not in out:
                    out.append(cand)
        return out

    def _next_read_files(self) -> list[str]:
        """Files with unread lines, in queue order; refills the queue from the backlog."""
        pending = [f for f in self.read_queue if self.cursors.get(f, 1) <= len(self._lines(f))]
        if len(pending) < MAX_PARALLEL_CALLS and self.backlog:
            take = self.backlog[: MAX_PARALLEL_CALLS * 2]
            self.backlog = self.backlog[len(take):]
            self.read_queue += take
            pending = [f for f in self.read_queue if self.cursors.get(f, 1) <= len(self._lines(f))]
        if not pending:  # everything read: the agent re-reads from the top
            self.cursors.clear()
            pending = list(self.read_queue)
        return list(dict.fromkeys(pending))

    def _lines(self, path: str) -> list[str]:
        return self.ws.text(path).splitlines()

    def _read_turn(self, budget: int) -> Turn | None:
        files = self._next_read_files()
        calls: list[tuple[str, int, int]] = []  # (path, offset, limit)
        room = budget - 40
        for path in files[:MAX_PARALLEL_CALLS]:
            if room < (120 if calls else 40):  # a first call may be a few lines; extra calls more
                break
            offset = self.cursors.get(path, 1)
            lines = read_lines(self.ws, path, 1, len(self._lines(path)))
            est = self.line_tokens(("read", path, self.ws.version(path)), lines)[offset - 1 :]
            n, used = 0, 30  # 30: the call and the result markers
            for t in est[:MAX_READ_LINES]:
                if used + t > room:
                    break
                used += t
                n += 1
            if n == 0:
                continue
            calls.append((path, offset, n))
            room -= used
        if not calls:
            return None
        for _ in range(20):  # exact check; shrink the last call until the turn fits
            turn = self._read_turn_for(calls)
            over = self.turn_tokens(turn) - budget
            if over <= 0:
                return turn
            path, offset, n = calls[-1]
            per_line = max(1.0, sum(self.line_tokens(("read", path, self.ws.version(path)), [])
                                    [offset - 1 : offset - 1 + n]) / n)
            n -= max(1, math.ceil(over * 1.1 / per_line))
            calls[-1:] = [(path, offset, n)] if n > 0 else []
            if not calls:
                return None
        return None

    def _read_turn_for(self, calls: list[tuple[str, int, int]]) -> Turn:
        inputs, results = [], []
        for path, offset, limit in calls:
            total = len(self._lines(path))
            if offset == 1 and limit >= total:
                inputs.append(("Read", {"file_path": path}))
            else:
                inputs.append(("Read", {"file_path": path, "offset": offset, "limit": limit}))
            results.append("\n".join(read_lines(self.ws, path, offset, limit)))
        p0, o0, l0 = calls[0]
        if len(calls) > 1:
            names = ", ".join(f"`{p}`" for p, _, _ in calls)
            text = self.rng.choice(
                ["I'll read {names} in parallel.", "Let me look at {names} together.",
                 "Reading the related modules {names}."]
            ).format(names=names)
        elif o0 > 1:
            text = f"Let me continue reading `{p0}` from line {o0}."
        else:
            text = self.rng.choice(
                ["Let me read `{p}`.", "I'll open `{p}` to see the implementation.",
                 "Now let me look at `{p}`."]
            ).format(p=p0)

        def commit():
            for path, offset, limit in calls:
                self.cursors[path] = offset + limit
                if path not in self.read_done:
                    self.read_done.append(path)

        return Turn(text, inputs, results, commit)

    def _grep_patterns(self) -> list[tuple[str, str, str]]:
        """(pattern, path, what) candidates from the focus file's real names."""
        fns = self.tree.functions(self.focus)
        mod = module_name(self.focus)
        top = mod.split(".")[0]
        out = [
            (rf"\b{self.focus_fn.name}\(", "", f"calls of `{self.focus_fn.name}`"),
            (rf"^(from|import) {mod.replace('.', '[.]')}\b", "", f"imports of `{mod}`"),
            (rf"\b{top}\.", self.focus_dir, f"uses of `{top}.`"),
        ]
        for f in fns:
            if f.name.startswith("__"):
                continue  # dunder names match everywhere; an agent searches for specific names
            out.append((rf"def {f.name}\b", self.focus_dir, f"the definition of `{f.name}`"))
            out.append((rf"\b{f.name}\(", self.focus_dir or "", f"calls of `{f.name}`"))
        return out

    def _grep_turn(self, budget: int) -> Turn | None:
        pats = [p for p in self._grep_patterns() if (p[0], p[1]) not in self.grep_done]
        if not pats:
            return None
        pattern, path, what = self.rng.choice(pats[:12])
        files_mode = budget < 150 or self.rng.random() < 0.2
        found = grep_files(self.ws, pattern, path) if files_mode else grep_lines(self.ws, pattern, path)
        where = path or "."

        def make(n: int) -> Turn:
            inp = {"pattern": pattern, "path": where,
                   "output_mode": "files_with_matches" if files_mode else "content"}
            if not files_mode:
                inp["-n"] = True
            if n < len(found):
                inp["head_limit"] = n
            if not found:
                result = "No matches found"
            elif files_mode:
                result = f"Found {len(found)} files\n" + "\n".join(found[:n])
            else:
                result = "\n".join(found[:n])
            text = self.rng.choice(["Let me search for {w}.", "I'll grep for {w}.",
                                    "Let me find {w} in `{p}`."]).format(w=what, p=where)
            return Turn(text, [("Grep", inp)], [result], lambda: self._after_grep(pattern, path, found, files_mode))

        if not found:
            turn = make(0)
            return turn if self.turn_tokens(turn) <= budget else None
        est = self.line_tokens(("grep", pattern, path, files_mode, sum(self.ws.versions.values())), found)
        return self._fit(make, len(found), est, budget)

    def _after_grep(self, pattern: str, path: str, found: list[str], files_mode: bool) -> None:
        self.grep_done.append((pattern, path))
        hits = found if files_mode else [f.split(":", 1)[0] for f in found]
        for f in hits[:5]:
            if f not in self.read_queue:
                self.read_queue.insert(min(len(self.read_queue), 2), f)
                if f in self.backlog:
                    self.backlog.remove(f)

    def _glob_turn(self, budget: int, force: bool = False) -> Turn | None:
        stem = self.focus.rsplit("/", 1)[-1][:-3].strip("_")[:4] or "a"
        patterns = [f"**/{stem}*.py", f"{self.focus_dir}/*.py" if self.focus_dir else "*.py",
                    f"{self.focus_dir}/**/*.py" if self.focus_dir else "**/__init__.py"]
        fresh = [p for p in patterns if p not in self.globs_done]
        if not fresh and not force:
            return None
        pattern = self.rng.choice(fresh) if not force else patterns[0]
        found = glob_files(self.ws, pattern)

        def make(n: int) -> Turn:
            shown = found[:n] if n else []
            more = len(found) - len(shown)
            result = "\n".join(shown) + (f"\n(Results are truncated: {more} more files)" if more else "")
            if not found:
                result = "No files found"
            return Turn(f"Let me list the files matching `{pattern}`.", [("Glob", {"pattern": pattern})],
                        [result.strip()], lambda: self.globs_done.append(pattern))

        if force:
            return make(min(1, len(found)))
        est = self.line_tokens(("glob", pattern), found)
        return self._fit(make, len(found), est, budget) if found else make(0)

    def _ls_turn(self, budget: int) -> Turn | None:
        """The focus directory's listing if not yet shown and it fits, else the largest fitting
        listing among a few other directories."""
        others = [d for d in self.tree.dirs if d != self.focus_dir and d not in self.listed]
        order = ([self.focus_dir] if self.focus_dir not in self.listed else []) + self.rng.sample(
            others, min(6, len(others)))
        fitting = []
        for d in order:
            lines = listing_lines(self.ws, d)
            turn = Turn(f"Let me look at the layout of `{d or '.'}`.", [("LS", {"path": d or "."})],
                        ["\n".join(lines)], lambda d=d: self.listed.append(d))
            if self.turn_tokens(turn) <= budget:
                if d == self.focus_dir:
                    return turn
                fitting.append((len(lines), turn))
        if not fitting:
            return None
        return max(fitting, key=lambda x: x[0])[1]

    def _command_turn(self, budget: int, module: str, verb: str) -> Turn | None:
        fresh = [p for p in self.read_done or [self.focus] if (module, p) not in self.commands_done]
        if not fresh:
            return None
        path = self.rng.choice(fresh)
        if module == "ast" and len(self.ws.text(path)) > 60_000:
            return None  # the AST dump of a big file is megabytes; an agent would not ask for it
        out = run_python(self.ws, ("-m", module), path)

        def make(n: int) -> Turn:
            cmd = f"python -m {module} < {path} | head -n {n}"
            inp = {"command": cmd, "description": f"{verb} {path}"}
            return Turn(f"Let me {verb.lower()} `{path}`.", [("Bash", inp)], ["\n".join(out[:n])],
                        lambda: self.commands_done.append((module, path)))

        est = self.line_tokens((module, path, self.ws.version(path)), out)
        return self._fit(make, len(out), est, budget)

    def _tokenize_turn(self, budget: int) -> Turn | None:
        return self._command_turn(budget, "tokenize", "Show the token stream of")

    def _ast_turn(self, budget: int) -> Turn | None:
        return self._command_turn(budget, "ast", "Dump the syntax tree of")

    def _check_turn(self, budget: int, force: bool = False) -> Turn | None:
        path = self.pending_check or self.focus
        out = run_python(self.ws, ("-c", CHECK_SCRIPT), path)
        cmd = f'python -c "{CHECK_SCRIPT}" < {path}'

        def commit():
            self.pending_check = None

        return Turn(
            "Let me check that the file still parses.",
            [("Bash", {"command": cmd, "description": f"Syntax check {path}"})],
            ["\n".join(out)],
            commit,
        )

    def _edit_turn(self, budget: int) -> Turn | None:
        e = self.edits[0]
        if self.ws.text(e.path).count(e.old) != 1:
            self.edits.pop(0)
            return None
        probe = Workspace(self.tree, dict(self.ws.edits), dict(self.ws.versions))
        start = probe.replace(e.path, e.old, e.new)
        result = edit_result(probe, e.path, start, e.new.count("\n") + 1)
        name = e.fn.qualname
        text = {
            "annotate": f"`{name}` never returns a value, so I'll annotate it `-> None`.",
            "guard": f"I'll add a None check at the top of `{name}`.",
            "docstring": f"I'll add a one-line docstring to `{name}`.",
        }[e.kind]

        def commit():
            self.ws.replace(e.path, e.old, e.new)
            self.edits.pop(0)
            self.edits_done.append(e)
            self.pending_check = e.path

        inp = {"file_path": e.path, "old_string": e.old, "new_string": e.new}
        return Turn(text, [("Edit", inp)], [result], commit)

    def _summary(self) -> str:
        read = ", ".join(f"`{p}`" for p in self.read_done[:8]) or "nothing"
        if self.edits_done:
            lines = "\n".join(f"- `{e.path}`: {e.description}" for e in self.edits_done)
            return (f"Done. I read {read} and made these changes:\n{lines}\n"
                    f"The edited files still parse (checked with `ast.parse`).")
        searched = "; the searches above show where it is used" if self.grep_done else ""
        return (f"I read {read}. `{self.focus_fn.qualname}` is defined in `{self.focus}` at line "
                f"{self.focus_fn.lineno}{searched}. I have not changed any code.")
