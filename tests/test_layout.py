"""The library facade and the package layout: the README's example runs, the public names
import, modules form no import cycle, and commands never import each other."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import mlx_dflash

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mlx_dflash"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node, except under `if TYPE_CHECKING:` (annotations only, never imported)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def _is_module(dotted: str) -> bool:
    path = ROOT / Path(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path) -> set[str]:
    """The mlx_dflash modules `path` imports at run time, at any depth (a function-level import
    closes a cycle as surely as a top-level one). `from pkg import submodule` counts as the
    submodule only: a package is always imported before its submodules."""
    tree = ast.parse(path.read_text())
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("mlx_dflash"):
                subs = {f"{mod}.{a.name}" for a in node.names if _is_module(f"{mod}.{a.name}")}
                found |= subs if len(subs) == len(node.names) else subs | {mod}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mlx_dflash")}
    return found - {name}


def test_readme_library_example_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Library.*?```python\n(.*?)```", readme, re.S)
    assert block, "the README has no library example"
    script = tmp_path / "example.py"
    script.write_text(block.group(1))
    assert len(block.group(1).strip().splitlines()) <= 14
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "tau" in done.stdout and len(done.stdout) > 100


def test_public_api():
    for name in mlx_dflash.__all__:
        assert hasattr(mlx_dflash, name), name
    for name in ("load_pair", "Session", "GenerationConfig", "generate_rounds"):
        assert name in mlx_dflash.__all__
    assert {"stream_generate", "Stats", "Conversation", "encode_prompt"} <= set(mlx_dflash.__all__)


def test_no_import_cycles():
    graph = {module_name(p): imports(p) for p in PKG.rglob("*.py")}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack, node, nxt]))
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_commands_do_not_import_each_other_and_the_library_not_the_cli():
    commands = {p.stem for p in (PKG / "cli").glob("*.py")} - {"__init__", "options"}
    for p in PKG.rglob("*.py"):
        used = imports(p)
        if p.parent.name == "cli" and p.stem in commands:
            others = {f"mlx_dflash.cli.{c}" for c in commands - {p.stem}}
            assert not used & others, f"{p.name} imports another command: {used & others}"
        elif p.parent.name != "cli":
            assert not any(u.startswith("mlx_dflash.cli") for u in used), p


def test_the_engine_reaches_models_through_its_contract_alone():
    """engine/ never imports models/ (engine/contract.py is what it asks of them), asks no
    object for an attribute by name (getattr: a member the contract does not name), and no
    class anywhere forwards attributes it does not define (__getattr__)."""
    for p in (PKG / "engine").glob("*.py"):
        used = imports(p)
        assert not any(u.startswith("mlx_dflash.models") for u in used), (p.name, used)
        calls = [
            n
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
        ]
        assert not calls, f"{p.name}:{calls[0].lineno} calls getattr"
    for p in PKG.rglob("*.py"):
        defs = [
            n.lineno
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
        ]
        assert not defs, f"{p.relative_to(ROOT)}:{defs[0]} forwards attributes (__getattr__)"


# The layers beneath the facade, and what each may import (docs/architecture.md, "Rules the
# layout keeps"): the shared utilities, kernels, the engine, then models with checkpoints.
BASE = {"errors", "settings", "paths", "atomic", "progress", "_blas"}
MAY_IMPORT = {
    "kernels": {"base", "engine.device"},
    "engine": {"base", "kernels"},
    "models": {"base", "kernels", "engine", "checkpoints", "distributed"},
    "checkpoints": {"base", "models"},
}


def layer(dotted: str) -> str:
    part = dotted.split(".")[1]
    return "base" if part in BASE else part


def test_each_layer_imports_only_what_the_architecture_doc_says():
    for p in PKG.rglob("*.py"):
        name = module_name(p)
        src = layer(name) if "." in name else "facade"
        for used in imports(p) if src in MAY_IMPORT else ():
            short = used.removeprefix("mlx_dflash.")
            allowed = MAY_IMPORT[src] | {src}
            assert layer(used) in allowed or short in allowed, f"{name} imports {used}"


def test_the_environment_is_read_once_into_settings():
    """Only settings.py reads os.environ (SETTINGS, at import); distributed.py may ask whether
    mlx.launch started the process (mlx's own variables, LAUNCH_ENV)."""
    for p in PKG.rglob("*.py"):
        if p.name == "settings.py":
            continue
        text = p.read_text()
        lines = text.splitlines()
        for n in ast.walk(ast.parse(text)):
            if not (isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv")):
                continue
            if getattr(n.value, "id", None) != "os":
                continue
            if p.name == "distributed.py" and "LAUNCH_ENV" in lines[n.lineno - 1]:
                continue
            raise AssertionError(f"{p.relative_to(ROOT)}:{n.lineno} reads the environment")


def test_no_server_module_runs_over_350_lines():
    """One module per wire API, the transport and the request's preparation apart (issue 49)."""
    for p in (PKG / "server").glob("*.py"):
        n = len(p.read_text().splitlines())
        assert n <= 350, f"server/{p.name} has {n} lines"


def test_importing_mlx_first_warns_on_linux():
    """OpenBLAS only takes over when it loads before mlx: a library user who imports mlx
    first is told so, rather than silently getting 10-30x slower float32 matmuls."""
    if not sys.platform.startswith("linux"):
        return
    code = "import mlx.core; import mlx_dflash; print(mlx_dflash._blas.loaded_blas)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "import mlx_dflash first" in done.stderr and done.stdout.strip() == "None"
    ok = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import mlx_dflash; import mlx.core"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr


def test_no_function_runs_over_80_lines_nor_over_60_in_the_engine():
    """The package's functions fit a screen; the engine's a smaller one (issue 49)."""
    long = [
        f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for p in PKG.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and n.end_lineno - n.lineno + 1 > (60 if p.parent.name == "engine" else 80)
    ]
    assert not long, long


def test_only_tests_edit_sys_path_and_nothing_imports_tests():
    """Scripts, recipes and training tools use the installed package (and convert/ runs as
    `python -m convert.X` from the repo root), never tests/ helpers or a patched sys.path."""
    test_modules = {p.stem for p in (ROOT / "tests").glob("*.py")}
    found = []
    for root in ("mlx_dflash", "scripts", "training", "convert", "metal"):
        for p in (ROOT / root).rglob("*.py"):
            tree = ast.parse(p.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
                    found.append(f"{p.relative_to(ROOT)}:{node.lineno} sys.path")
                mods = []
                if isinstance(node, ast.ImportFrom) and not node.level:
                    mods = [node.module or ""]
                elif isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                for m in mods:
                    if m.split(".")[0] in test_modules | {"tests"}:
                        found.append(f"{p.relative_to(ROOT)}:{node.lineno} imports {m}")
    assert not found, found


def test_lint_covers_training_and_scripts():
    makefile = (ROOT / "Makefile").read_text()
    linted = re.search(r"^LINTED\s*:=\s*(.+)$", makefile, re.M).group(1).split()
    assert {"mlx_dflash", "tests", "convert", "training", "scripts"} <= set(linted)
    lint = makefile[makefile.index("\nlint:") :].split("\n\n")[0]
    assert "ruff check $(LINTED)" in lint and "mypy" in lint
