"""The shell commands that README.md and docs/ show: every line of their fenced ```bash / ```sh
blocks, as a reader would type it (tests/unit/test_docs_commands.py checks that each is run)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
SHELLS = {"bash", "sh", "shell"}


@dataclass(frozen=True)
class Command:
    path: str
    line: int
    text: str
    """The command line: continuation lines joined, a trailing comment removed, blanks collapsed.
    A heredoc's body is not part of it (`heredoc` holds it)."""
    heredoc: str = ""

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def strip_comment(line: str) -> str:
    """`cmd --x   # why` -> `cmd --x`; a # inside quotes or inside a word stays."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def shell_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every fenced shell block, dedented by its fence's indent."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, marker, lang = m.groups()
        body, i = [], i + 1
        while i < len(lines) and lines[i].strip() != marker:
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if lang in SHELLS:
            blocks.append((i - len(body), body))  # the opening fence's line number
        i += 1
    return blocks


def commands_in(path: Path, root: Path = ROOT) -> list[Command]:
    out = []
    for first, body in shell_blocks(path.read_text()):
        j = 0
        while j < len(body):
            start, line = first + j + 1, body[j]
            j += 1
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            while line.rstrip().endswith("\\") and j < len(body):
                line = line.rstrip()[:-1] + " " + body[j].strip()
                j += 1
            heredoc = []
            m = HEREDOC.search(line)
            if m:
                while j < len(body) and body[j].strip() != m.group(2):
                    heredoc.append(body[j])
                    j += 1
                j += 1  # the delimiter
            text = " ".join(strip_comment(line).split())
            out.append(Command(str(path.relative_to(root)), start, text, "\n".join(heredoc)))
    return out


def all_commands(root: Path = ROOT) -> list[Command]:
    return [c for path in doc_files(root) for c in commands_in(path, root)]


if __name__ == "__main__":
    for c in all_commands():
        print(f"{c.where():45} {c.text}")
