"""The codebase's shape, enforced: no import cycle between modules (imports inside functions
count: a cycle through a lazy import is still a cycle a reader has to untangle) and no module
over 450 lines but the trainer (the one training loop, kept whole on purpose)."""

from __future__ import annotations

from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("hpc_core", "registry", "agent", "exporters", "device_profiles", "fleet",
            "contract")
MAX_LINES = 450
EXEMPT = {"hpc_core/trainer.py"}


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    mods = sorted(graph.modules)
    adj = {m: sorted(x for x in graph.find_modules_directly_imported_by(m) if x in graph.modules)
           for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in mods:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            for j in range(i, len(adj[v])):
                w = adj[v][j]
                if w not in index:
                    work += [(v, j + 1), (w, 0)]
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
    return out


def test_no_import_cycles_even_through_function_level_imports() -> None:
    # grimp reads every import statement, those inside functions included; those under
    # ``if TYPE_CHECKING:`` name a type for the checker and never run, so they are left out.
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    assert "agent.storage.lock" in graph.find_modules_directly_imported_by(
        "agent.jobs.steps.pull")  # imported inside pull.run only
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from cyc import b\n")
    (pkg / "b.py").write_text("from cyc import a\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        assert _cycles(grimp.build_graph("cyc")) == [["cyc.a", "cyc.b"]]
    finally:
        sys.path.remove(str(tmp_path))


def test_no_module_over_450_lines_but_the_trainer() -> None:
    long = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            n = len(path.read_text().splitlines())
            if n > MAX_LINES and rel not in EXEMPT:
                long[rel] = n
    assert long == {}, f"split these along their seams: {long}"


def test_the_longest_first_list_names_files_that_exist() -> None:
    # A file moved or renamed without these lists following it would silently run last again.
    from tests.conftest import LONGEST_FIRST, MOSTLY_WAITING

    listed = [*LONGEST_FIRST, *MOSTLY_WAITING]
    assert [f for f in listed if not (REPO / f).is_file()] == []
    assert len(set(listed)) == len(listed), "a file in both lists"


def test_the_waiting_files_start_spread_among_the_others() -> None:
    import math

    from tests.conftest import LONGEST_FIRST, MOSTLY_WAITING, file_order

    others = [f"tests/t{i:03d}.py" for i in range(80)]
    files = [*others[:30], *reversed(MOSTLY_WAITING), *others[30:], *LONGEST_FIRST]
    order = file_order(files)
    assert sorted(order) == sorted(files)  # every file once
    assert order[:len(LONGEST_FIRST)] == list(LONGEST_FIRST)
    rest = order[len(LONGEST_FIRST):]
    assert [f for f in rest if f in others] == others  # the others keep collection order
    # In the listed order, the k-th after (k + 1) gaps of others; two gaps close the run.
    gap = len(others) / (len(MOSTLY_WAITING) + 2)
    before = [sum(1 for f in rest[:rest.index(w)] if f in others) for w in MOSTLY_WAITING]
    assert before == [math.ceil(gap * (k + 1)) for k in range(len(MOSTLY_WAITING))], before
    assert len(others) - before[-1] >= 2 * gap - 1, before
    # Fewer files than the list: the ones that are there, nothing invented.
    assert file_order([MOSTLY_WAITING[0], "tests/a.py"]) == ["tests/a.py", MOSTLY_WAITING[0]]


def test_no_folder_holds_more_than_25_modules() -> None:
    # Past that a folder's file-name prefixes are packages asking to exist (fleet/ had 35).
    crowded = {}
    for pkg in PACKAGES:
        for folder in [REPO / pkg, *(p for p in (REPO / pkg).rglob("*") if p.is_dir())]:
            n = len(list(folder.glob("*.py")))
            if n > 25:
                crowded[folder.relative_to(REPO).as_posix()] = n
    assert crowded == {}, f"split these by concern: {crowded}"
