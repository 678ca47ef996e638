"""No import cycles, and each layer imports only the layers below it (Ray's test_circular_imports.py
does the first the same way: every module imported on its own, nothing of the package loaded before).

Every import statement counts, those inside functions too: an import deferred into a function is still
a dependency, and a cycle hidden that way is still a cycle."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "raytp"

# Who may import whom: a module of a layer imports raytp modules of its own layer or of those listed.
LAYERS = {
    "raytp.names": set(), "raytp.trust": set(), "raytp.seeds": set(), "raytp.tp_degrees": set(),
    "raytp.eager_adamw": set(),
    "raytp.initialization": {"raytp.seeds"},
    "raytp.parallel": {"raytp.seeds"},
    "raytp.models": {"raytp.trust", "raytp.seeds", "raytp.initialization", "raytp.parallel", "raytp.tp_degrees"},
    "raytp.train": {"raytp.models", "raytp.parallel", "raytp.seeds", "raytp.eager_adamw"},
    "raytp.files": {"raytp.trust", "raytp.models", "raytp.parallel", "raytp.train",
                    "raytp.moves"},  # checkpoints read the table
    "raytp.moves": {"raytp.models", "raytp.parallel"},
    "raytp.data": {"raytp.trust", "raytp.seeds", "raytp.files"},
    "raytp.config": {"raytp.trust", "raytp.names", "raytp.models", "raytp.parallel", "raytp.train",
                     "raytp.tp_degrees"},
    "raytp.runtime": {"raytp.trust", "raytp.names", "raytp.models", "raytp.parallel", "raytp.train", "raytp.files",
                      "raytp.data", "raytp.config", "raytp.seeds", "raytp.moves"},
    "raytp.head": {"raytp.names", "raytp.runtime"},
    "raytp.jobs": {"raytp.trust", "raytp.names", "raytp.runtime", "raytp.head", "raytp.config"},
    "raytp.api": {"raytp.trust", "raytp.names", "raytp.config", "raytp.runtime", "raytp.train", "raytp.files",
                  "raytp.parallel", "raytp.data",
                  "raytp.head"},
    "raytp.cli": {"raytp.trust", "raytp.names", "raytp.config", "raytp.runtime", "raytp.train", "raytp.files",
                  "raytp.models", "raytp.data",
                  "raytp.head",
                  "raytp.jobs", "raytp.api"},
}


def modules() -> list[str]:
    out = []
    for f in sorted(PKG.rglob("*.py")):
        if f.name == "__main__.py":  # runs the command line when imported
            continue
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(parts))
    return out


def imports_of(module: str) -> set[str]:
    """The raytp modules `module` imports, anywhere in it (module level, functions, methods)."""
    path = PKG.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PKG.parent / module.replace(".", "/") / "__init__.py"
    known, found = set(modules()), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from raytp import names` imports the module raytp.names, as `import raytp.names` does
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found |= subs | ({node.module} if len(subs) < len(node.names) else set())
    return {m for m in found if m in known and m.startswith("raytp") and m != module}


def layer(module: str) -> str:
    return max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)


def test_no_import_cycles():
    graph = {m: imports_of(m) for m in modules()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_each_layer_imports_only_those_below_it():
    bad = []
    for m in modules():
        if m == "raytp":
            continue
        allowed = LAYERS[layer(m)] | {layer(m)}
        bad += [f"{m} imports {n}" for n in imports_of(m) if n != "raytp" and layer(n) not in allowed]
    assert not bad, "\n".join(bad)


# raytp.runtime's rooms, lowest first (docs/architecture.md); its root modules (policy, records, errors,
# estimate, ...) lie below them all and import none of them.
ROOMS = ["cluster", "worker", "state", "elastic", "recovery", "driver", "coordinator"]


def room(module: str) -> int:
    """The place of `module`'s room in ROOMS; -1 for a module at raytp.runtime's root."""
    parts = module.split(".")
    return ROOMS.index(parts[2]) if len(parts) > 3 else -1


def test_each_runtime_room_imports_only_those_below_it():
    """A room imports its own modules, lower rooms' and the root's: never a room above it (TYPE_CHECKING
    imports count: a type named from above is a dependency on it too)."""
    runtime = [m for m in modules() if m.startswith("raytp.runtime.")]
    bad = [f"{m} imports {n}" for m in runtime for n in imports_of(m)
           if n.startswith("raytp.runtime.") and room(n) > room(m)]
    assert not bad, "\n".join(bad)


@pytest.mark.slow  # over 10 s: the full suite's, not the quick tier's
def test_every_module_imports_on_its_own():
    script = (
        "import importlib, sys\n"
        f"names = {modules()!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'raytp' or m.startswith('raytp.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       cwd=PKG.parent)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
