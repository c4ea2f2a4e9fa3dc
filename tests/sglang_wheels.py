"""SGLang's own source, read from its PyPI wheels, for the audit tests (and to regenerate our flag table).

What it knows: where the wheels are cached (`$KVFENCE_SGLANG_WHEELS`, else ~/.cache/kvfence/sglang-wheels; files
as `pip download --no-deps sglang==X -d DIR` names them), how to read one source file of one version straight
from the zip, and how to extract, statically with `ast` (nothing of SGLang is imported or run), two facts per
version: every `ServerArgs` field name, and every launch option with its destination, arity and value parser,
following the rules of SGLang's own `add_cli_args_from_dataclass` (arg_groups/arg_utils.py) plus the options
`ServerArgs.add_cli_args` registers by hand. The fields are ALL fields of the record, with or without CLI metadata
(`stat_loggers`, `custom_sigquit_handler`, ... have none): 0.5.19's `ServerArgs` is a dataclass in server_args.py;
from 0.5.20 it is a msgspec struct assembled from the classes listed in `_INPUT_NAMESPACES` (server_args.py, each
declared in arg_groups/fields/*.py) plus the annotations of the `ServerArgs` class body, so its fields are the
annotated attributes of those classes (`ClassVar`s excluded). `resolved_dict()` (the start-up line and
`/server_info`) prints exactly these fields.
What it does not know: anything decided at run time (resolution hooks, dynamic choices).

`python tests/sglang_wheels.py --write` rewrites kvfence/audit/sglang_flags.py from the cached wheels;
`python tests/sglang_wheels.py --check` exits 1 when that file no longer matches them.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import sys
import textwrap
import zipfile
from functools import cache
from pathlib import Path

VERSIONS = ("0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
FLAGS_MODULE = Path(__file__).resolve().parent.parent / "kvfence" / "audit" / "sglang_flags.py"


def wheel_dir() -> Path:
    env = os.environ.get("KVFENCE_SGLANG_WHEELS")
    return Path(env) if env else Path.home() / ".cache" / "kvfence" / "sglang-wheels"


def wheel_path(version: str) -> Path | None:
    hits = sorted(glob.glob(str(wheel_dir() / f"sglang-{version}-*.whl")))
    return Path(hits[0]) if hits else None


def available_versions() -> list[str]:
    return [v for v in VERSIONS if wheel_path(v) is not None]


@cache
def _zip(version: str) -> zipfile.ZipFile:
    path = wheel_path(version)
    if path is None:
        raise FileNotFoundError(f"no sglang {version} wheel under {wheel_dir()}")
    return zipfile.ZipFile(path)


@cache
def source(version: str, relpath: str) -> str | None:
    """Text of sglang/srt/<relpath> in that version, or None when the file does not exist there."""
    try:
        return _zip(version).read(f"sglang/srt/{relpath}").decode("utf-8")
    except KeyError:
        return None


def _field_sources(version: str) -> list[str]:
    names = sorted(
        n
        for n in _zip(version).namelist()
        if n == "sglang/srt/server_args.py" or re.fullmatch(r"sglang/srt/arg_groups/fields/[^/]+\.py", n)
    )
    return [_zip(version).read(n).decode("utf-8") for n in names]


# ---------------------------------------------------------------------------------------------
# Static extraction
# ---------------------------------------------------------------------------------------------


def _lit(node: ast.AST | None, default: object = None) -> object:
    if node is None:
        return default
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return default


def _annotated(ann: ast.AST) -> tuple[ast.AST, dict[str, ast.AST] | None] | None:
    """(type, Arg(...) keywords or {} for a bare help string, or None without CLI metadata) of `A[T, ...]`."""
    if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) in ("A", "Annotated")):
        return None
    elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    for meta in elts[1:]:
        if isinstance(meta, ast.Call) and getattr(meta.func, "id", None) == "Arg":
            return elts[0], {k.arg: k.value for k in meta.keywords if k.arg}
        if isinstance(meta, (ast.Constant, ast.JoinedStr, ast.BinOp)):  # bare help text
            return elts[0], {}
    return elts[0], None


def _strip_optional(t: ast.AST) -> str:
    s = ast.unparse(t)
    for pat in (r"Optional\[(.*)\]", r"(.*) \| None", r"None \| (.*)", r"Union\[(.*), None\]"):
        m = re.fullmatch(pat, s)
        if m:
            return m.group(1)
    return s


def _kind(type_src: str | None) -> str:
    """Our value kinds: 'hri' (SGLang's human_readable_int), 'int', 'float', 'str'."""
    if type_src is None:
        return "str"
    if type_src.endswith("human_readable_int"):
        return "hri"
    return type_src if type_src in ("int", "float") else "str"


def _zero_arity(action_src: str) -> bool:
    markers = ("store_true", "store_false", "StoreTrue", "StoreConst", "BooleanOptional")
    return any(x in action_src for x in markers) or action_src.endswith("DeprecatedAction")


@cache
def _record_classes(version: str) -> list[ast.ClassDef]:
    """The class bodies whose annotated attributes are the fields of that version's ServerArgs record."""
    tree = ast.parse(source(version, "server_args.py") or "")
    record = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    listed: list[str] | None = None
    for st in tree.body:
        if isinstance(st, ast.Assign) and any(getattr(t, "id", None) == "_INPUT_NAMESPACES" for t in st.targets):
            listed = [e.id for e in st.value.elts if isinstance(e, ast.Name)]  # type: ignore[attr-defined]
    if listed is None:  # 0.5.19: one dataclass
        return [record]
    declared: dict[str, ast.ClassDef] = {}
    for text in _field_sources(version):
        for cls in (n for n in ast.parse(text).body if isinstance(n, ast.ClassDef)):
            declared.setdefault(cls.name, cls)
    missing = [n for n in listed if n not in declared]
    if missing:
        raise ValueError(f"sglang {version}: _INPUT_NAMESPACES names classes not found: {missing}")
    return [declared[n] for n in listed] + [record]


def _field_statements(cls: ast.ClassDef) -> list[ast.AnnAssign]:
    return [
        st
        for st in cls.body
        if isinstance(st, ast.AnnAssign)
        and isinstance(st.target, ast.Name)
        and "ClassVar" not in ast.unparse(st.annotation)
    ]


@cache
def record_fields(version: str) -> frozenset[str]:
    """Every field of that version's ServerArgs record: the keys of its `server_args={...}` line."""
    return frozenset(st.target.id for cls in _record_classes(version) for st in _field_statements(cls))  # type: ignore[union-attr]


@cache
def extract(version: str) -> tuple[frozenset[str], dict[str, tuple[str, object, str]]]:
    """(ServerArgs field names, {option string: (dest, nargs, kind)}) of one version."""
    options: dict[str, tuple[str, object, str]] = {}
    for text in _field_sources(version):
        tree = ast.parse(text)
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for st in cls.body:
                if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                    continue
                ann = _annotated(st.annotation)
                if ann is None:
                    continue
                name = st.target.id
                typ, kw = ann
                if kw is None or _lit(kw.get("no_cli"), False):
                    continue
                cli = _lit(kw.get("cli_name")) or "--" + name.replace("_", "-")
                names = [cli, *(_lit(kw.get("aliases")) or [])]
                nargs = _lit(kw.get("nargs"))
                parser = ast.unparse(kw["type_parser"]) if "type_parser" in kw else None
                inner = _strip_optional(typ)
                if "action" in kw:
                    act = ast.unparse(kw["action"])
                    akw = kw.get("action_kwargs")
                    if isinstance(akw, ast.Dict):
                        for k, v in zip(akw.keys, akw.values, strict=True):
                            if _lit(k) == "nargs":
                                nargs = _lit(v)
                    if act.endswith("BooleanOptionalAction"):
                        for n in names:
                            options[n] = (name, 0, "true")
                            options["--no-" + n[2:]] = (name, 0, "false")
                        continue
                    n_ = nargs if nargs is not None else (0 if _zero_arity(act) else 1)
                    kind = "false" if "store_false" in act else ("true" if n_ == 0 else _kind(parser))
                    for n in names:
                        options[n] = (name, n_, kind)
                    continue
                if inner.startswith("Literal["):
                    entry = (name, 1, _kind(parser))
                elif re.match(r"(List|list)\[", inner) and parser is None:
                    entry = (name, nargs or "+", "str")
                elif inner == "bool":
                    entry = (name, 0, "true")
                else:
                    entry = (name, nargs if nargs is not None else 1, _kind(parser or inner))
                for n in names:
                    options[n] = entry
        # Options registered by hand inside ServerArgs.add_cli_args.
        for fn in ast.walk(tree):
            if not (isinstance(fn, ast.FunctionDef) and fn.name == "add_cli_args"):
                continue
            for call in ast.walk(fn):
                if not (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "add_argument"
                ):
                    continue
                names = [str(_lit(a)) for a in call.args if isinstance(a, ast.Constant)]
                kw = {k.arg: k.value for k in call.keywords if k.arg}
                dest = str(_lit(kw.get("dest")) or names[0].lstrip("-").replace("-", "_"))
                act = ast.unparse(kw["action"]) if "action" in kw else ""
                if "nargs" in kw:
                    n_ = _lit(kw["nargs"])
                    n_ = 1 if n_ is None else n_
                else:
                    n_ = 0 if act and _zero_arity(act) else 1
                type_src = ast.unparse(kw["type"]) if "type" in kw else None
                kind = "false" if "store_false" in act else ("true" if n_ == 0 else _kind(type_src))
                for n in names:
                    options[n] = (dest, n_, kind)
    return record_fields(version), options


def _default(node: ast.AST | None) -> object:
    """A field's default as SGLang declares it: literals, `field(default_factory=list|dict)`, number arithmetic."""
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        pass
    if isinstance(node, ast.Call):
        kw = {k.arg: k.value for k in node.keywords}
        factory = kw.get("default_factory")
        if isinstance(factory, ast.Name) and factory.id in ("list", "dict"):
            return [] if factory.id == "list" else {}
        if "default" in kw:  # field(default=X, ...)
            return _default(kw["default"])
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
        a, b = _default(node.left), _default(node.right)
        if isinstance(a, int) and isinstance(b, int):
            return a * b if isinstance(node.op, ast.Mult) else a + b
    return None


def field_defaults(version: str) -> dict[str, object]:
    """Every ServerArgs field of a version with its declared default (what a start-up line shows unset)."""
    return dict(_field_defaults(version))


@cache
def _field_defaults(version: str) -> dict[str, object]:
    return {
        st.target.id: _default(st.value)  # type: ignore[union-attr]
        for cls in _record_classes(version)
        for st in _field_statements(cls)
    }


def dataclass_fields(version: str, relpath: str, name: str) -> list[tuple[str, object]]:
    """(field, declared default) of a dataclass of that version, in declaration order (its repr's order)."""
    tree = ast.parse(source(version, relpath) or "")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return [(st.target.id, _default(st.value)) for st in _field_statements(cls)]  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# The generated table
# ---------------------------------------------------------------------------------------------


def _span(present: list[bool]) -> tuple[int, int]:
    idx = [i for i, p in enumerate(present) if p]
    if idx != list(range(idx[0], idx[-1] + 1)):
        raise ValueError("a name that disappears and comes back needs a richer table")
    return idx[0], idx[-1]


def render_table() -> str:
    per = {v: extract(v) for v in VERSIONS}
    all_fields = sorted(set().union(*(f for f, _ in per.values())))
    all_opts = sorted(set().union(*(o.keys() for _, o in per.values())))
    lines = [
        "# ruff: noqa: E501",
        "# fmt: off",
        '"""SGLang 0.5.19 .. 0.5.23: every ServerArgs field and every launch option (generated; do not edit).',
        "",
        "What it knows: for each version (an index into VERSIONS), which ServerArgs fields exist (all of them, with",
        "or without a launch option: the keys of the `server_args={...}` start-up line and of `/server_info`), and",
        "which options `sglang serve` / `python -m sglang.launch_server` accept, with destination field, arity (0, 1,",
        "'+', '*', '?') and value kind ('true'/'false' for flags, 'hri' for SGLang's human_readable_int, 'int',",
        "'float', 'str').",
        "What it does not know: defaults or choices. Written by `python tests/sglang_wheels.py --write` from the",
        "PyPI wheels (sglang/srt/server_args.py and sglang/srt/arg_groups/fields/*.py, read with ast).",
        '"""',
        "",
        f"VERSIONS = {VERSIONS!r}",
        "",
        "# (first version index, last version index) -> the field names that exist in exactly those versions",
        "_FIELDS_BY_SPAN: dict[tuple[int, int], tuple[str, ...]] = {",
    ]
    by_span: dict[tuple[int, int], list[str]] = {}
    for name in all_fields:
        by_span.setdefault(_span([name in per[v][0] for v in VERSIONS]), []).append(name)
    for span in sorted(by_span):
        lines.append(f"    {span}: (")
        lines += textwrap.wrap(
            " ".join(f"{n!r}," for n in by_span[span]),
            112,
            initial_indent=" " * 8,
            subsequent_indent=" " * 8,
            break_on_hyphens=False,
        )
        lines.append("    ),")
    lines += [
        "}",
        "# field name -> (first version index, last version index)",
        "FIELDS: dict[str, tuple[int, int]] = {n: span for span, names in _FIELDS_BY_SPAN.items() for n in names}",
        "",
        "# option -> (dest, nargs, kind, first version index, last version index); dest None: the option's own name",
        "OPTIONS: dict[str, tuple[str | None, int | str, str, int, int]] = {",
    ]
    for opt in all_opts:
        entries = {per[v][1][opt] for v in VERSIONS if opt in per[v][1]}
        if len(entries) != 1:
            raise ValueError(f"{opt} changes meaning across versions: {entries}")
        dest, nargs, kind = entries.pop()
        first, last = _span([opt in per[v][1] for v in VERSIONS])
        shown = None if dest == opt[2:].replace("-", "_") else dest
        lines.append(f"    {opt!r}: ({shown!r}, {nargs!r}, {kind!r}, {first}, {last}),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    missing = [v for v in VERSIONS if wheel_path(v) is None]
    if missing:
        print(f"missing wheels under {wheel_dir()}: {missing} (pip download --no-deps sglang==X -d DIR)")
        return 2
    text = render_table()
    if "--write" in argv:
        FLAGS_MODULE.write_text(text, encoding="utf-8")
        print(f"wrote {FLAGS_MODULE}")
        return 0
    same = FLAGS_MODULE.read_text(encoding="utf-8") == text
    print("up to date" if same else f"{FLAGS_MODULE} differs from the wheels")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
