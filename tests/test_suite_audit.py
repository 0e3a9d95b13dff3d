"""The test suite checked for assertions that cannot fail (AST scan of every tests/*.py).

Flagged: an assert of a truthy constant; a comparison of an expression with itself
(``a == a``, ``a <= a`` ...); an ``or`` with a truthy constant (``... or True``); ``len(x) >= 0``;
membership of an element in the very collection it is iterated from (``for x in S: assert x
in S``, ``all(x in S for x in S)``); and ``pytest.raises`` of a tuple that includes the
emulator's build error next to AssertionError (a mutant that does not compile is not caught).
What a scan cannot see (two names bound to the same object) was reviewed by hand: see issue 17.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
FILES = sorted(p for p in TESTS.rglob("*.py") if p.name.startswith("test_"))


def _same(a: ast.AST, b: ast.AST) -> bool:
    return ast.unparse(a) == ast.unparse(b)  # ignores load/store context


def _truthy_constant(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and bool(node.value) and node.value is not Ellipsis


class _Scan(ast.NodeVisitor):
    def __init__(self) -> None:
        self.problems: list[str] = []
        self._loops: list[ast.For] = []

    def _flag(self, node: ast.AST, what: str) -> None:
        self.problems.append(f"line {node.lineno}: {what}: {ast.unparse(node)[:100]}")

    def visit_For(self, node: ast.For) -> None:
        self._loops.append(node)
        self.generic_visit(node)
        self._loops.pop()

    def visit_Assert(self, node: ast.Assert) -> None:
        test = node.test
        if _truthy_constant(test):
            self._flag(node, "assert of a constant")
        self._check_expr(test, node)
        self.generic_visit(node)

    def _check_expr(self, test: ast.AST, where: ast.AST) -> None:
        for sub in ast.walk(test):
            if (isinstance(sub, ast.BoolOp) and isinstance(sub.op, ast.Or)
                    and any(_truthy_constant(v) for v in sub.values)):
                self._flag(where, "'or' with a truthy constant")
            if isinstance(sub, ast.Compare):
                left = sub.left
                for op, right in zip(sub.ops, sub.comparators):
                    if isinstance(op, (ast.Eq, ast.Is, ast.LtE, ast.GtE)) and _same(left, right):
                        self._flag(where, "a value compared with itself")
                    if (isinstance(op, ast.GtE) and isinstance(right, ast.Constant)
                            and right.value == 0 and isinstance(left, ast.Call)
                            and getattr(left.func, "id", "") == "len"):
                        self._flag(where, "len(...) >= 0")
                    if isinstance(op, ast.In):
                        for loop in self._loops:
                            if _same(loop.target, left) and _same(loop.iter, right):
                                self._flag(where, "membership in the collection iterated")
                    left = right
            if isinstance(sub, (ast.GeneratorExp, ast.ListComp, ast.SetComp)):
                elt = sub.elt
                if isinstance(elt, ast.Compare) and len(elt.ops) == 1 and isinstance(
                        elt.ops[0], ast.In):
                    for gen in sub.generators:
                        if _same(gen.target, elt.left) and _same(gen.iter, elt.comparators[0]):
                            self._flag(where, "membership in the collection iterated")

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            call = item.context_expr
            if (isinstance(call, ast.Call) and ast.unparse(call.func).endswith("raises")
                    and call.args and isinstance(call.args[0], ast.Tuple)):
                names = {ast.unparse(e) for e in call.args[0].elts}
                if "AssertionError" in names and any("EmulatorError" in n for n in names):
                    self._flag(node, "a build failure counted as a caught mutant")
        self.generic_visit(node)


def scan(source: str) -> list[str]:
    s = _Scan()
    s.visit(ast.parse(source))
    return s.problems


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_assertion_that_cannot_fail(path: Path) -> None:
    assert scan(path.read_text()) == []


@pytest.mark.parametrize("source", [
    "assert True",
    "assert a.b == a.b",
    "assert x.theme_actions['light'].isChecked() or True",
    "assert len(items) >= 0",
    "for c in CATS:\n    assert c in CATS",
    "assert all(m in NAMES for m in NAMES)",
    "with pytest.raises((AssertionError, gen.EmulatorError)):\n    pass",
])
def test_the_scan_finds_each_kind(source: str) -> None:
    assert len(scan(source)) == 1, source


def test_the_scan_passes_real_assertions() -> None:
    assert scan("assert a == b\nassert x or y\nfor c in A:\n    assert c in B\n") == []
