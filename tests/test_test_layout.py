"""No test module is imported by another module under tests/: shared scaffolding lives in tests/helpers/.

Imports are read from the source with `ast`, not by importing: `import tests.test_x`, `from tests.test_x
import y`, `from tests import test_x`, a bare `import test_x` and relative forms (`from .test_x import y`,
`from . import test_x`) all count, inside functions too. Imports built from strings are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent


def is_test_module(dotted: str) -> bool:
    """`dotted` names a test module: its last part starts with `test_` (tests.test_x, test_x, .test_x)."""
    return dotted.rsplit(".", 1)[-1].startswith("test_")


def imports_of_test_modules(source: str) -> list[tuple[int, str]]:
    """(line, imported test module) for every import of a test module in `source`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if module.strip(".") and is_test_module(module):
                found.append((node.lineno, module))
            elif module.strip(".") in ("", "tests"):  # `from tests import test_x`, `from . import test_x`
                sep = "" if module.endswith(".") else "."
                found += [(node.lineno, f"{module}{sep}{a.name}") for a in node.names if is_test_module(a.name)]
    return found


def test_the_scan_sees_every_form_of_importing_a_test_module() -> None:
    source = "\n".join(
        [
            "import tests.test_a",
            "from tests.test_b import x",
            "from tests import test_c, helpers",
            "import test_d",
            "from .test_e import y",
            "from . import test_f",
            "def f():\n    from tests.test_g import z",
            "from tests.helpers.kv import seed_pool",
            "import tests.helpers",
            "from kvfence.server import api",
        ]
    )
    got = [name for _, name in imports_of_test_modules(source)]
    assert sorted(got) == [
        ".test_e",
        ".test_f",
        "test_d",
        "tests.test_a",
        "tests.test_b",
        "tests.test_c",
        "tests.test_g",
    ]


def test_no_module_under_tests_imports_a_test_module() -> None:
    offenders = [
        f"{path.relative_to(TESTS_DIR.parent)}:{line}: imports {name}"
        for path in sorted(TESTS_DIR.rglob("*.py"))
        for line, name in imports_of_test_modules(path.read_text())
    ]
    assert not offenders, "move what is shared into tests/helpers/:\n" + "\n".join(offenders)
