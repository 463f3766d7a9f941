"""The GPU test modules that re-run another module's tests (`import test_gpu as base`, then
`base.test_x(gen, ...)`; any test module imported under another name) only run on a GPU, so a new
required argument of the callee shows up there as a TypeError, after CI has passed (2026-12-06:
test_cuda_graph_replay gained H and the context-parallel wrapper did not pass it).  This CPU test
reads the sources and checks every such call against the callee's signature.
"""

import ast
import pathlib

HERE = pathlib.Path(__file__).parent


def functions(path):
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def imported_test_modules(tree):
    """{alias: module} of the test modules imported under another name (`import test_gpu as base`)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name.startswith("test_"):
                    out[alias.asname] = alias.name
    return out


def missing_arguments(call, callee):
    """Required parameters of callee that call does not pass (positionally or by keyword)."""
    params = [a.arg for a in callee.args.args]
    required = params[: len(params) - len(callee.args.defaults)]
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return []  # *args / **kwargs: not decidable statically
    passed = set(params[: len(call.args)]) | {k.arg for k in call.keywords}
    return [p for p in required if p not in passed]


def wrapper_calls():
    """(module, line, callee name, callee def or None, call) for every <alias>.test_* call."""
    for path in sorted(HERE.glob("test_gpu*.py")):
        tree = ast.parse(path.read_text())
        callees = {a: functions(HERE / f"{m}.py") for a, m in imported_test_modules(tree).items()}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in callees
                    and node.func.attr.startswith("test_")):
                yield path.name, node.lineno, node.func.attr, callees[node.func.value.id].get(node.func.attr), node


def test_there_are_wrapper_calls_to_check():
    assert sum(1 for _ in wrapper_calls()) >= 10


def test_every_wrapper_call_passes_the_callees_required_arguments():
    problems = []
    for mod, line, name, callee, call in wrapper_calls():
        if callee is None:
            problems.append(f"{mod}:{line}: {call.func.value.id}.{name} does not exist")
            continue
        miss = missing_arguments(call, callee)
        if miss:
            problems.append(f"{mod}:{line}: {call.func.value.id}.{name}(...) misses {', '.join(miss)}")
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_missing_argument():
    callee = ast.parse("def test_f(gen, H, D=128): pass").body[0]
    assert missing_arguments(ast.parse("base.test_f(gen)").body[0].value, callee) == ["H"]
    assert missing_arguments(ast.parse("base.test_f(gen, H=4)").body[0].value, callee) == []
    assert missing_arguments(ast.parse("base.test_f(gen, 4)").body[0].value, callee) == []
