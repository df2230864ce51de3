"""The package's shape in numbers: how many modules and how long, the largest class, the median function.

    python -m benchmarks.shape                 # the working tree
    python -m benchmarks.shape --rev COMMIT    # the package as committed at COMMIT (read with git)
    python -m benchmarks.shape --json          # the same figures as JSON

Lines are physical lines of the source (docstrings, comments and blank lines included). A function's length
runs from its ``def`` line to its last line (decorators excluded); every function and method counts, nested
ones included. The largest class is the longest ``class`` statement anywhere in the package.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "context_persistent"


def sources(rev: str | None) -> dict[str, str]:
    """Every ``.py`` file of the package (path relative to the repository -> text), from the tree or a commit."""
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
                for p in sorted((ROOT / PACKAGE).rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, PACKAGE], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout for n in names if n.endswith(".py")}


def shape(files: dict[str, str]) -> dict[str, Any]:
    """The figures for ``files`` (path -> source text)."""
    sizes = {path: len(text.splitlines()) for path, text in files.items()}
    classes: list[tuple[int, str]] = []
    functions: list[int] = []
    for path, text in files.items():
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{path}:{node.name}"))  # type: ignore[operator]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append(node.end_lineno - node.lineno + 1)  # type: ignore[operator]
    largest = max(classes)
    ordered = sorted(sizes.items(), key=lambda kv: -kv[1])
    return {"modules": len(sizes), "lines": sum(sizes.values()), "largest_modules": ordered[:8],
            "median_module_lines": statistics.median(sizes.values()),
            "largest_class": {"name": largest[1], "lines": largest[0]},
            "functions": len(functions), "median_function_lines": statistics.median(functions),
            "functions_over_50_lines": sum(1 for n in functions if n > 50)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shape", description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git commit to measure instead of the working tree")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = shape(sources(args.rev))
    if args.json:
        import json

        print(json.dumps(figures, indent=2))
        return 0
    print(f"modules: {figures['modules']} ({figures['lines']} lines; median {figures['median_module_lines']})")
    print("largest modules: " + ", ".join(f"{p} {n}" for p, n in figures["largest_modules"]))
    print(f"largest class: {figures['largest_class']['name']} ({figures['largest_class']['lines']} lines)")
    print(f"functions: {figures['functions']}, median {figures['median_function_lines']} lines, "
          f"{figures['functions_over_50_lines']} over 50 lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
