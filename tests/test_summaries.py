"""Each chapter's summary ("What you now know") prints the values its sections computed: every
name the summary reads is bound by one cell before it. A name bound again by a later section
(a loop over other models, another `total`) would make the summary print that section's value
under the first one's words; two chapter-16 numbers once came out that way.

Read statically, from the notebooks' code: imports may repeat (the same module or function each
time), and so may a binding written the same way each time (`hl, hh = best`)."""

import ast
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[01]*.ipynb"))
SUMMARY = re.compile(r"^## What you now know", re.M)
# bound by the banner cell (`start_chapter`) and again by the chapter's own visible cell, which
# loads the same model and prompt as the reader would: the same values
SAME_BY_DESIGN = {"model", "PROMPT"}


def targets(node) -> list[str]:
    """The names an assignment's target binds: `x`, `a, b`; not `d[k]` or `o.x`."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for e in node.elts for n in targets(e)]
    return targets(node.value) if isinstance(node, ast.Starred) else []


class TopLevel(ast.NodeVisitor):
    """The names a cell binds at its top level (not inside functions or comprehensions), each
    with the source of what binds it; imports apart."""

    def __init__(self, source: str):
        self.source, self.bound, self.imported = source, {}, set()

    def visit_Assign(self, node):
        for target in node.targets:
            for name in targets(target):
                self.bound.setdefault(name, []).append(ast.get_source_segment(self.source,
                                                                             node.value))
        self.visit(node.value)

    def visit_AugAssign(self, node):
        if isinstance(node.target, ast.Name):
            self.bound.setdefault(node.target.id, []).append(None)  # changes it: never alike

    def visit_For(self, node):
        for name in targets(node.target):
            self.bound.setdefault(name, []).append(None)
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    def visit_FunctionDef(self, node):
        self.bound.setdefault(node.name, []).append(ast.get_source_segment(self.source, node))

    def visit_ClassDef(self, node):
        self.visit_FunctionDef(node)

    def visit_Import(self, node):
        self.imported |= {(a.asname or a.name).split(".")[0] for a in node.names}

    visit_ImportFrom = visit_Import

    def visit_ListComp(self, node):  # a comprehension's names are its own
        pass

    visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_Lambda = visit_ListComp


def read_names(tree: ast.AST) -> set[str]:
    """Names a cell reads that it does not bind itself."""
    own = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
           and isinstance(n.ctx, ast.Store)}
    own |= {a.arg for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))
            for a in n.args.args}
    own |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load)} - own


def rebound(path: Path) -> dict[str, list[int]]:
    """The names the summary reads that cells before it bind differently more than once."""
    cells = json.loads(path.read_text())["cells"]
    start = next(i for i, c in enumerate(cells)
                 if c["cell_type"] == "markdown" and SUMMARY.search("".join(c["source"])))
    reads, bindings = set(), {}
    for i, c in enumerate(cells):
        if c["cell_type"] != "code":
            continue
        source = "".join(c["source"])
        tree = ast.parse(source)
        if i > start:
            reads |= read_names(tree)
            continue
        top = TopLevel(source)
        top.visit(tree)
        for name, values in top.bound.items():
            bindings.setdefault(name, []).extend((i, v) for v in values)
    return {name: sorted({i for i, _ in b}) for name, b in bindings.items()
            if name in reads and name not in SAME_BY_DESIGN
            and (len(b) > 1 and (None in {v for _, v in b} or len({v for _, v in b}) > 1))}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_summary_reads_what_its_sections_computed(path):
    assert rebound(path) == {}, (
        "the summary reads names that more than one cell binds (name: cells); give each "
        "section's value a name of its own")


def test_the_check_sees_a_name_bound_twice(tmp_path):
    """The chapter-16 slip, on a made-up notebook: the summary reads `total`, last bound by a
    loop over other models."""
    def cell(kind, text):
        return {"cell_type": kind, "source": [text], "metadata": {}}

    nb = {"cells": [cell("code", "total = 12"), cell("code", "for c in cs:\n    total = f(c)"),
                    cell("markdown", "## What you now know"),
                    cell("code", "say(f'{total}')")]}
    path = tmp_path / "00_made_up.ipynb"
    path.write_text(json.dumps(nb))
    assert rebound(path) == {"total": [0, 1]}
