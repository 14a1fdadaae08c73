"""The documentation runs and its links resolve.

* Every ```python block of README.md and docs/*.md is executed as written, each in a fresh namespace (the snippets
  are small, so this file takes seconds on 2 cores). A block whose first line is `# needs a GPU` is skipped where
  there is no CUDA GPU. docs/SPEC.md is the contract, kept verbatim: its one python block lists signatures, so it
  is not executed (tests/test_spec_signatures.py compares them with the code); its links are checked.
* Every relative link of README.md, docs/*.md and benchmarks/README.md points to an existing file, and a link to
  a heading (`file.md#heading`) to an existing heading of that file.
* Every `benchmarks/README.md, "Title"` (and `docs/x.md, "Title"`) cited in the code names a heading that exists,
  so code comments can point at the evidence.
* README.md stays a front page (at most 150 lines), and its speed table is benchmarks/speed_table.py's output
  for the committed JSON.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import dilated_attn

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED_PAGES = [*PAGES, ROOT / "benchmarks" / "README.md"]
NOT_EXECUTED = {ROOT / "docs" / "SPEC.md"}
GPU_MARK = "# needs a GPU"
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def split_page(path: Path):
    """(prose lines with their numbers, code blocks as (language, first line number, source))."""
    prose, blocks = [], []
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence, language, start, body = m.group(2), m.group(3).lower(), number + 1, []
            else:
                prose.append((number, line))
        elif m and m.group(2).startswith(fence) and not m.group(3) and line.strip() == m.group(2):
            blocks.append((language, start, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{_rel(path)}: unclosed code fence"
    return prose, blocks


def python_blocks():
    for page in PAGES:
        if page in NOT_EXECUTED:
            continue
        for language, line, source in split_page(page)[1]:
            if language in ("python", "py"):
                yield pytest.param(page, line, source, id=f"{_rel(page)}:{line}")


PYTHON_BLOCKS = list(python_blocks())


def needs_gpu(source: str) -> bool:
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    return first == GPU_MARK


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 150, f"README.md has {lines} lines: move details to docs/ and keep the front page short"


def test_readme_speed_table_is_generated_from_the_committed_json():
    import importlib.util

    spec = importlib.util.spec_from_file_location("speed_table", ROOT / "benchmarks" / "speed_table.py")
    speed_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speed_table)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert speed_table.replace_in(text, speed_table.render()) == text, \
        "README.md's speed table differs: run python benchmarks/speed_table.py --write"


def test_the_docs_have_snippets():
    assert any(p.values[0].name == "README.md" for p in PYTHON_BLOCKS), "the README's example was not found"
    gpu_only = sum(needs_gpu(p.values[2]) for p in PYTHON_BLOCKS)
    assert gpu_only < len(PYTHON_BLOCKS) / 2, "most snippets must run on a CPU"


@pytest.mark.parametrize("page, line, source", PYTHON_BLOCKS)
def test_snippet_runs(page, line, source, monkeypatch):
    if needs_gpu(source) and not torch.cuda.is_available():
        pytest.skip("marked '# needs a GPU'")
    # as a user would run them: no backend forced, not under torchrun
    for name in ("DILATED_ATTN_BACKEND", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    code = compile(source, f"{_rel(page)}:{line}", "exec")
    # line numbers of tracebacks count from the block's first line
    exec(code, {"__name__": "__main__"})


# --- links ----------------------------------------------------------------------------------------------------------

INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text, lower case, without punctuation, spaces turned into hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for _, line in split_page(path)[0]:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path):
    for number, line in split_page(path)[0]:
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, m.group(1)


@pytest.mark.parametrize("page", LINKED_PAGES, ids=_rel)
def test_relative_links_resolve(page):
    broken = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"line {number}: {target} (no heading #{anchor} in {_rel(dest)})")
    assert not broken, f"{_rel(page)}:\n  " + "\n  ".join(broken)


CITATION = re.compile(r"((?:benchmarks/README|docs/[\w-]+)\.md),\s*\"([^\"]+)\"")
CODE_DIRS = ("src", "benchmarks", "tools", "examples", "tests", "csrc")


def test_headings_cited_in_the_code_exist():
    cited = []
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".sh", ".cpp", ".h", ".cu", ".cuh") or not path.is_file():
                continue
            if path == Path(__file__).resolve():  # this docstring's examples
                continue
            text = re.sub(r"\s*\n\s*(?:#|//)?\s*", " ", path.read_text(encoding="utf-8"))  # join wrapped comments
            cited += [(_rel(path), page, title) for page, title in CITATION.findall(text)]
    assert any(page == "benchmarks/README.md" for _, page, _ in cited), "expected citations of benchmarks/README.md"
    missing = [f"{source}: {page}, \"{title}\"" for source, page, title in cited
               if not (ROOT / page).exists() or slug(title) not in anchors(ROOT / page)]
    assert not missing, "cited headings that do not exist:\n  " + "\n  ".join(missing)


@pytest.mark.parametrize("name", ["dilated_attention", "ring_attention"])
def test_help_of_the_main_functions(name):
    """help() of the two main functions: Args, Returns and an example, in 80 columns (help indents by 4); the
    ring's example is a whole launch recipe."""
    import inspect

    doc = inspect.getdoc(getattr(dilated_attn, name))
    assert "Args:" in doc and "Returns:" in doc and "Example" in doc
    assert max(len(line) for line in doc.splitlines()) + 4 <= 80
    if name == "ring_attention":
        assert "torchrun --nproc_per_node" in doc and "init_process_group" in doc
