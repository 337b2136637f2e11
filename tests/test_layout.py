"""The package's architecture as a property of its import statements: no import circles, layers that
import only downwards (the engine knows nothing of policies' files, training, evaluation or
pictures), and modules a reader can hold in mind (at most 550 lines of code and 800 lines in all:
explanations in docstrings and comments do not force a module to be cut)."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import Dict, List, Set

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "timm_dora"
MAX_CODE_LINES = 550  # statements: docstrings, comments and blank lines not counted
MAX_LINES = 800

# bottom up: a module may import from its own layer and the layers below it, never above
LAYERS = [
    {"timm_dora.version", "timm_dora.data", "timm_dora.backbone", "timm_dora.command"},
    {"timm_dora.engine"},
    {"timm_dora.policy"},
    {"timm_dora.hub"},
    {"timm_dora.api", "timm_dora"},
    {"timm_dora.train", "timm_dora.evaluate", "timm_dora.viz", "timm_dora.partition"},
    {"timm_dora.cli", "timm_dora.__main__"},
]
APPLICATIONS = ("timm_dora.train", "timm_dora.evaluate", "timm_dora.viz")  # independent of each other


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> Set[str]:
    """Every timm_dora module that ``name`` imports, at module level or inside functions
    (``from pkg import sub`` counts as importing ``pkg.sub`` where that is a module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("timm_dora"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("timm_dora"):
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(target)
    return {m for m in out if m in MODULES and m != name}


GRAPH: Dict[str, Set[str]] = {m: imports(m) for m in MODULES}


def layer(module: str) -> int:
    best = None
    for i, members in enumerate(LAYERS):
        for prefix in members:
            if module == prefix or (prefix != "timm_dora" and module.startswith(prefix + ".")):
                best = i
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def test_the_walk_sees_the_package():
    assert {"timm_dora", "timm_dora.api", "timm_dora.engine.patch", "timm_dora.train.loop"} <= set(MODULES)
    assert "timm_dora.engine.blocks" in GRAPH["timm_dora.engine.patch"]
    assert "timm_dora.engine.graphs" in GRAPH["timm_dora.engine.patch"]  # a module-level import
    assert "timm_dora.train.pool" in GRAPH["timm_dora.train.loop"]  # `from . import pool as P`


def test_no_import_circles():
    """Tarjan's strongly connected components of the import graph: each must be one module."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert circles == []


def test_layers_import_only_downwards():
    upward = sorted((m, t) for m, ts in GRAPH.items() for t in ts if layer(t) > layer(m))
    assert upward == []


def test_the_engine_knows_nothing_above_it():
    engine = [m for m in GRAPH if m.startswith("timm_dora.engine")]
    assert len(engine) >= 8
    outside = sorted((m, t) for m in engine for t in GRAPH[m] if not t.startswith("timm_dora.engine"))
    assert outside == []


def test_applications_do_not_import_each_other():
    crossing = sorted((m, t) for m, ts in GRAPH.items() for t in ts
                      for a in APPLICATIONS for b in APPLICATIONS
                      if a != b and m.startswith(a) and t.startswith(b))
    assert crossing == []


def code_lines(text: str) -> int:
    """The lines of ``text`` that hold code: not blank, not only a comment, not a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip:
            lines.update(l for l in range(tok.start[0], tok.end[0] + 1) if l not in docstrings)
    return len(lines)


def test_code_lines_counts_statements_only():
    text = '"""Doc\nstring."""\n\n# a comment\nx = (1,\n     2)  # trailing\n\ndef f():\n    """Doc."""\n    return x\n'
    assert code_lines(text) == 4  # x = (1, / 2) / def f(): / return x


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    text = MODULES[name].read_text()
    lines, code = len(text.splitlines()), code_lines(text)
    assert lines <= MAX_LINES and code <= MAX_CODE_LINES, f"{name}: {lines} lines, {code} of code"


def _module_constants(prefixes=("timm_dora.engine", "timm_dora.policy")) -> Set[str]:
    """The UPPER_CASE names bound at module level in the engine's and the policies' modules."""
    names: Set[str] = set()
    for name, path in MODULES.items():
        if name.startswith(prefixes):
            for node in ast.parse(path.read_text()).body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
                names.update(t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper())
    return names


def test_engine_settings_are_options_not_module_switches():
    """How the engine runs lives in ``EngineOptions`` on the wrapped model: no ``global`` statement in
    the engine or the policies, and no test or benchmark reassigns (or monkeypatches) one of their
    module-level constants."""
    for name, path in MODULES.items():
        if name.startswith(("timm_dora.engine", "timm_dora.policy")):
            tree = ast.parse(path.read_text())
            assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], name
    constants = _module_constants()
    modules = {n.rsplit(".", 1)[-1] for n in MODULES if n.startswith(("timm_dora.engine.", "timm_dora.policy."))}
    assert {"BACKENDS", "ACTOR", "READOUTS"} <= constants  # (the scan sees them)
    root = PACKAGE.parent
    offenders = []
    for path in sorted([*root.glob("tests/*.py"), *root.glob("benchmarks/*.py")]):
        text = path.read_text()
        for m in re.finditer(r"setattr\(\s*[\w.]+\s*,\s*[\"']([A-Z][A-Z0-9_]*)[\"']", text):
            if m.group(1) in constants:
                offenders.append(f"{path.name}: setattr {m.group(1)}")
        for m in re.finditer(r"\b(\w+)\.([A-Z][A-Z0-9_]*)\s*(?:,[^=\n]*)?=[^=]", text):
            if m.group(2) in constants or m.group(1) in modules:
                offenders.append(f"{path.name}: assigns {m.group(1)}.{m.group(2)}")
    assert offenders == []


def _policy_accesses(tree: ast.AST) -> Set[str]:
    """Attributes read of a policy object (``policy.x``, ``self.policy.x``, ``getattr(policy, "x")``)."""
    def is_policy(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "policy") or (
            isinstance(node, ast.Attribute) and node.attr == "policy")

    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_policy(node.value):
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and is_policy(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            out.add(node.args[1].value)
    return out


def test_the_engine_asks_of_a_policy_only_what_the_protocol_declares():
    from timm_dora.engine.protocol import OPTIONAL_ATTRIBUTES, CapturedPolicy

    declared = {n for n in vars(CapturedPolicy) if not n.startswith("_")} | set(OPTIONAL_ATTRIBUTES) | {"__call__"}
    assert {"probe", "decide", "prepare", "controller_fixed", "probes_in_graphs", "fused_gate", "context_width"} <= declared
    asked = {}
    for name, path in MODULES.items():
        if name.startswith("timm_dora.engine"):
            for attr in _policy_accesses(ast.parse(path.read_text())):
                asked.setdefault(attr, []).append(name)
    assert {"probe", "speculate"} <= set(asked)  # (the walk sees the executors' calls)
    assert {a: m for a, m in asked.items() if a not in declared} == {}


def test_the_code_cites_no_notebook():
    """Code comments cite results files and guides, not the speed work's notebook."""
    assert [n for n, p in MODULES.items() if "speed_notes" in p.read_text() or "speed notes" in p.read_text()] == []


def test_attention_backends_are_named_in_one_table():
    """The backends' properties live in ``engine.attention.BACKEND_INFO``: outside that module and
    its kernel no engine or policy module names a backend to decide what it may do."""
    from timm_dora.engine.attention import BACKEND_INFO

    names = "|".join(BACKEND_INFO)
    for name, path in MODULES.items():
        if name.startswith(("timm_dora.engine", "timm_dora.policy")) and name not in (
                "timm_dora.engine.attention", "timm_dora.engine.varlen_kernel"):
            code = re.sub(r'"""(?:.|\n)*?"""|#.*', "", path.read_text())  # (docstrings and comments out)
            assert re.findall(rf"backend\s*(?:==|!=|in|not in)\s*\(?[\"'](?:{names})[\"']", code) == [], name
