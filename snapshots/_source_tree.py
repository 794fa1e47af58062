"""A Python source tree read once into memory, and a per-session workspace of in-memory edits.

The synthetic traces read real files from here; edits made by a simulated agent live only in a
`Workspace` overlay: the tree on disk is never written.
"""

from __future__ import annotations

import ast
import hashlib
import platform
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path


class SourceTreeError(RuntimeError):
    """The source directory is missing or holds no usable Python files."""


@dataclass(frozen=True)
class FunctionInfo:
    """One function definition found by `ast` (lines are 1-based, as in the file)."""

    name: str
    qualname: str
    lineno: int
    def_line: str  # the text of the `def` line
    body_lineno: int  # first statement after a docstring (or the first statement)
    body_indent: str
    has_docstring: bool
    returns_value: bool  # has `return <expr>` or yields
    annotated: bool  # has a return annotation
    first_param: str | None  # first parameter other than self/cls


class SourceTree:
    """Sorted *.py files under `root` (relative posix paths), UTF-8 text kept in memory.

    Refuses a missing root or one with no readable Python files. Files under a directory named in
    `exclude_dirs`, larger than `max_file_bytes`, or not valid UTF-8 are left out (deterministically).
    """

    def __init__(self, root: str | Path, exclude_dirs=("__pycache__",), max_file_bytes=400_000):
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise SourceTreeError(f"source directory {self.root} does not exist")
        excluded = set(exclude_dirs)
        texts: dict[str, str] = {}
        for p in sorted(self.root.rglob("*.py"), key=lambda q: q.relative_to(self.root).as_posix()):
            rel = p.relative_to(self.root)
            if excluded.intersection(rel.parts[:-1]) or not p.is_file():
                continue
            data = p.read_bytes()
            if len(data) > max_file_bytes:
                continue
            try:
                texts[rel.as_posix()] = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
        if not texts:
            raise SourceTreeError(f"no usable *.py files under {self.root}")
        self.texts = texts
        self.files = list(texts)  # already sorted

    @cached_property
    def content_hash(self) -> str:
        """sha256 over every used file's relative path and content hash (order: sorted paths)."""
        h = hashlib.sha256()
        for rel, text in self.texts.items():
            h.update(f"{rel}\0{hashlib.sha256(text.encode()).hexdigest()}\n".encode())
        return h.hexdigest()

    def identity(self) -> dict:
        """What the manifest records about this tree: path, interpreter, file count, content hash."""
        return {
            "path": str(self.root),
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "n_files": len(self.files),
            "n_bytes": sum(len(t.encode()) for t in self.texts.values()),
            "content_hash": self.content_hash,
        }

    @cached_property
    def dirs(self) -> list[str]:
        """Every directory holding a used file ("" is the root), sorted."""
        out = {""}
        for rel in self.files:
            parts = rel.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                out.add("/".join(parts[:i]))
        return sorted(out)

    def files_under(self, d: str) -> list[str]:
        """Used files inside directory `d` (recursively), sorted; "" means the whole tree."""
        if not d:
            return list(self.files)
        prefix = d.rstrip("/") + "/"
        return [f for f in self.files if f.startswith(prefix)]

    def functions(self, rel: str) -> list[FunctionInfo]:
        """Function definitions of file `rel` (its original text), in source order; [] if unparsable."""
        return _functions(self.texts[rel])


def _functions(text: str) -> list[FunctionInfo]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out: list[FunctionInfo] = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                has_doc = (
                    isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)
                )
                first_stmt = body[1] if has_doc and len(body) > 1 else body[0]
                returns_value = any(
                    (isinstance(n, ast.Return) and n.value is not None)
                    or isinstance(n, (ast.Yield, ast.YieldFrom))
                    for n in _walk_own_body(child)
                )
                params = [a.arg for a in child.args.posonlyargs + child.args.args]
                if params and params[0] in ("self", "cls"):
                    params = params[1:]
                body_line = lines[first_stmt.lineno - 1]
                out.append(
                    FunctionInfo(
                        name=child.name,
                        qualname=prefix + child.name,
                        lineno=child.lineno,
                        def_line=lines[child.lineno - 1],
                        body_lineno=first_stmt.lineno,
                        body_indent=body_line[: len(body_line) - len(body_line.lstrip())],
                        has_docstring=has_doc,
                        returns_value=returns_value,
                        annotated=child.returns is not None,
                        first_param=params[0] if params else None,
                    )
                )
                visit(child, prefix + child.name + ".")

    visit(tree, "")
    return out


def _walk_own_body(fn):
    """Nodes of a function body, not descending into nested functions, classes or lambdas."""
    stack = list(fn.body)
    while stack:
        n = stack.pop()
        yield n
        for c in ast.iter_child_nodes(n):
            if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.append(c)


@dataclass
class Workspace:
    """A session's view of the tree: original files plus its own edits (never written to disk)."""

    tree: SourceTree
    edits: dict[str, str] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)

    def text(self, rel: str) -> str:
        return self.edits.get(rel, self.tree.texts[rel])

    def version(self, rel: str) -> int:
        """Bumped on every edit of `rel` (keys caches of derived data such as line token counts)."""
        return self.versions.get(rel, 0)

    def replace(self, rel: str, old: str, new: str) -> int:
        """Replace the single occurrence of `old` in `rel`; returns its 1-based start line.

        Refuses (ValueError) an `old` that occurs zero or several times, like an editor tool would.
        """
        text = self.text(rel)
        count = text.count(old)
        if count != 1:
            raise ValueError(f"{rel}: old_string occurs {count} times")
        at = text.index(old)
        self.edits[rel] = text[:at] + new + text[at + len(old) :]
        self.versions[rel] = self.version(rel) + 1
        return text.count("\n", 0, at) + 1


def interpreter() -> str:
    """The running interpreter (the one the traces' real commands run under)."""
    return sys.executable
