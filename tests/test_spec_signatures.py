"""The signatures docs/SPEC.md gives are the code's.

Every signature in a ```python block of docs/SPEC.md, a statement starting `dilated_attn.<name>(...)` or
`def <name>(...)` (the list may span lines), is compared with `inspect.signature` of `dilated_attn.<name>` (a
dotted name, `dilated_attn.X.forward`, resolves attribute by attribute): the same parameters, in the same order,
of the same kind (the `*` marking keyword-only ones counts) and with the same defaults. The test fails where the
page and the code disagree, and where it finds none of the entry points it must pin.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import dilated_attn

SPEC = Path(__file__).resolve().parents[1] / "docs" / "SPEC.md"
PYTHON_BLOCK = re.compile(r"^```(?:python|py)[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SIGNATURE_START = re.compile(r"^[ \t]*(?:def[ \t]+|dilated_attn\.)([A-Za-z_][\w.]*)[ \t]*\(", re.MULTILINE)
EMPTY = "<no default>"


def spec_signatures(markdown: str) -> list[tuple[str, str]]:
    """[(dotted name, the text between its parentheses)] for every signature of the page's python blocks."""
    found = []
    for block in PYTHON_BLOCK.findall(markdown):
        for m in SIGNATURE_START.finditer(block):
            depth, start = 1, m.end()
            for i in range(start, len(block)):
                depth += {"(": 1, ")": -1}.get(block[i], 0)
                if depth == 0:
                    found.append((m.group(1), block[start:i]))
                    break
            else:
                raise AssertionError(f"docs/SPEC.md: unclosed parameter list of {m.group(1)}")
    return found


def spec_parameters(params: str) -> list[tuple[str, str, str]]:
    """[(name, kind, repr of the default)] of a parameter list as written, parsed as a def's."""
    args = ast.parse(f"def f({params}): pass").body[0].args
    kinds = ([(a, "POSITIONAL_ONLY") for a in args.posonlyargs] + [(a, "POSITIONAL_OR_KEYWORD") for a in args.args]
             + ([(args.vararg, "VAR_POSITIONAL")] if args.vararg else [])
             + [(a, "KEYWORD_ONLY") for a in args.kwonlyargs] + ([(args.kwarg, "VAR_KEYWORD")] if args.kwarg else []))
    positional = args.posonlyargs + args.args
    defaults = dict(zip([a.arg for a in positional[len(positional) - len(args.defaults):]], args.defaults))
    defaults.update((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None)
    return [(a.arg, kind, repr(ast.literal_eval(defaults[a.arg])) if a.arg in defaults else EMPTY)
            for a, kind in kinds]


def code_parameters(dotted: str) -> list[tuple[str, str, str]]:
    obj = dilated_attn
    for part in dotted.split("."):
        assert hasattr(obj, part), f"docs/SPEC.md gives a signature of dilated_attn.{dotted}, which does not exist"
        obj = getattr(obj, part)
    return [(p.name, p.kind.name, EMPTY if p.default is p.empty else repr(p.default))
            for p in inspect.signature(obj).parameters.values()]


SIGNATURES = spec_signatures(SPEC.read_text(encoding="utf-8"))


def test_spec_gives_the_entry_points():
    names = {name for name, _ in SIGNATURES}
    assert {"dilated_attention", "dilated_attention_varlen", "ring_attention"} <= names, names


@pytest.mark.parametrize("name, params", SIGNATURES, ids=[name for name, _ in SIGNATURES])
def test_signature_matches_the_code(name, params):
    assert spec_parameters(params) == code_parameters(name), f"docs/SPEC.md and dilated_attn.{name} disagree"
