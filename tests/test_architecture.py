"""The package's shape, read from its import statements: no import cycles between modules, and
the KV cache (`kvserve.kv`) depends on nothing above it — not the model, the engine, the server,
the simulator or the request type — so it can be read, tested and reused on its own. Leaf
utilities (modules that import nothing of kvserve, like the dtype name table) are below
everything and may be used anywhere.

Every import counts, also those inside functions and under TYPE_CHECKING: a lazy import is still
a dependency, and a cycle hidden behind one is still a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvserve"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvserve modules it imports (a package import counts as its __init__)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_graph_reader_sees_imports():
    graph = import_graph()
    assert "kvserve.kv.block_pool" in graph["kvserve.kv.manager"]
    assert "kvserve.kv.manager" in graph["kvserve.engine.scheduler"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """kvserve's packages (kvserve.kv, kvserve.engine, ...; a top-level module is its own) ->
    the packages their modules import."""
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        out.setdefault(package(mod), set()).update(
            package(d) for d in deps if package(d) != package(mod))
    return out


def test_no_package_import_cycles():
    """Issue 47: the packages import one way (server, engine, parallel, worker, model_loader,
    models, layers, attention and kernels, kv), with no package cycle left."""
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_kv_imports_nothing_above_it():
    graph = import_graph()
    leaves = {mod for mod, deps in graph.items() if not deps and not mod.endswith("__init__")
              and mod != "kvserve"}
    upward = {(mod, dep) for mod, deps in graph.items() if mod.startswith("kvserve.kv")
              for dep in deps if not dep.startswith("kvserve.kv") and dep not in leaves}
    assert not upward, f"kvserve.kv imports from above it: {sorted(upward)}"


def test_the_gateway_imports_no_engine_model_or_server():
    """`kvserve route` is a small process: it names blocks with kv.hashing and may load a
    tokenizer, but the engine, the model (torch), the server and the simulator stay out; the
    simulator, for its part, may use the gateway's policies (one implementation)."""
    graph = import_graph()
    heavy = ("kvserve.engine", "kvserve.model", "kvserve.server", "kvserve.sim",  # models too
             "kvserve.planner", "kvserve.layers", "kvserve.kernels", "kvserve.attention")
    # `--tokenizer default` (or a .gguf) reads the embedded model's GGUF header, lazily, only
    # then: kvserve.model_loader.default and the GGUF reader import neither torch nor the model
    lazy_ok = {("kvserve.router.launch", "kvserve.model_loader.default"),
               ("kvserve.router.launch", "kvserve.model_loader.gguf_checkpoint")}
    bad = {(mod, dep) for mod, deps in graph.items() if mod.startswith("kvserve.router")
           for dep in deps if dep.startswith(heavy) and (mod, dep) not in lazy_ok}
    assert not bad, f"the gateway imports heavy modules: {sorted(bad)}"
    assert "kvserve.router.policies" in graph["kvserve.sim.replay"]


def test_the_gguf_reader_and_the_default_model_import_no_torch():
    """What the gateway may import of kvserve.model_loader stays free of torch and the
    decoder."""
    import subprocess
    import sys

    code = ("import sys; import kvserve.model_loader.default, "
            "kvserve.model_loader.gguf_checkpoint; "
            "print('torch' in sys.modules, 'kvserve.models.decoder' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    return seen


WORKER = "kvserve.worker.model_runner"
SCHEDULER_SIDE = {"kvserve.kv.manager", "kvserve.kv.prefix_index", "kvserve.kv.block_pool",
                  "kvserve.engine.scheduler", "kvserve.engine.llm_engine",
                  "kvserve.engine.async_engine", "kvserve.request"}


def test_the_worker_imports_nothing_of_the_scheduler_side():
    """The worker runs plain step messages (worker/step.py), so it can sit behind another
    process: nothing it imports, directly or not, is the KV manager, the scheduler, the engine
    or the request type."""
    graph = import_graph()
    assert "kvserve.worker.step" in graph[WORKER]
    leaked = sorted(_reachable(graph, WORKER) & SCHEDULER_SIDE)
    assert not leaked, f"the worker imports {leaked}"
    assert not _reachable(graph, "kvserve.worker.step") & SCHEDULER_SIDE


MODEL_CODE = ("kvserve.models.decoder", "kvserve.models.deepseek_layers", "kvserve.models")
# What chooses and binds kernels, and the kernels themselves: the model code runs the methods
# it is given (kvserve.layers.linear / block, kernel-free) and never reaches these.
KERNEL_CHOICE = ("kvserve.kernels", "kvserve.layers.selection", "kvserve.layers.gemm_select",
                 "kvserve.layers.cpu_linear", "kvserve.layers.cpu_layer_ops",
                 "kvserve.layers.fast_decode", "kvserve.layers.cpu_methods",
                 "kvserve.layers.quant_linear", "kvserve.layers.quant_decode",
                 "kvserve.layers.quantize_at_load", "kvserve.layers.kernel_choice",
                 "kvserve.layers.plan_cache")


def test_the_model_code_imports_no_kernel_choice():
    """The decoder, DeepSeek's layers and the architecture registry do not know which kernel
    runs: nothing they import, directly or not, is the GEMM plan, the code that chooses it, or
    the kernels package (they ask the ExecutionPlan they are handed for their methods)."""
    graph = import_graph()
    model = [m for m in graph if m.startswith(MODEL_CODE)]
    assert "kvserve.models.decoder" in model and "kvserve.models.registry" in model
    leaked = sorted((m, dep) for m in model for dep in _reachable(graph, m)
                    if dep.startswith(KERNEL_CHOICE))
    assert not leaked, f"model code reaches the kernel choice: {leaked[:10]}"
    # the plan is how the kernels get there: its CPU source is kernel code
    assert "kvserve.layers.plan" in graph["kvserve.models.decoder"]
    assert "kvserve.layers.plan" in graph["kvserve.layers.cpu_methods"]


def test_the_loader_imports_no_kernel_code():
    """Issue 47: the loader reads files and copies; the plan it builds the model with is
    made by its caller (kvserve.worker.model_build), so nothing it reaches chooses or runs a
    kernel."""
    graph = import_graph()
    for loader in ("kvserve.model_loader.loader", "kvserve.model_loader.gguf_checkpoint"):
        leaked = sorted(d for d in _reachable(graph, loader) if d.startswith(KERNEL_CHOICE))
        assert not leaked, f"{loader} reaches kernel code: {leaked[:10]}"
    assert "kvserve.layers.selection" in graph["kvserve.worker.model_build"]


def test_files_stay_under_600_lines():
    """Issue 30: a file of kvserve/ over 600 lines is a layout that hides its parts."""
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert not long, long


# -- issue 65 item 2: one kernel choice, at load --------------------------------------------
OLD_KERNEL_ENVS = ("KVSERVE_GEMM\"", "KVSERVE_GEMM'", "KVSERVE_GEMM=", "KVSERVE_QTILES",
                   "KVSERVE_QGEMM_ROWS")


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    """'Class.method' / 'function' -> its definition, in the module at `path`."""
    out: dict[str, ast.FunctionDef] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            out.update({f"{node.name}.{f.name}": f for f in node.body
                        if isinstance(f, ast.FunctionDef)})
    return out


def _names_in(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def test_one_kernel_override_read_in_one_place():
    """The kernel is forced by one variable, $KVSERVE_KERNEL, read by kernel_choice.override
    alone; the three it replaced (KVSERVE_GEMM, KVSERVE_QTILES, KVSERVE_QGEMM_ROWS) are
    named nowhere in the package."""
    readers, old = [], []
    for p in PACKAGE.rglob("*.py"):
        text = p.read_text(encoding="utf-8")
        if "KVSERVE_KERNEL\"" in text or "KERNEL_ENV" in text and "environ" in text:
            readers.append(p.name)
        old += [(p.name, e) for e in OLD_KERNEL_ENVS if e in text]
    assert readers == ["kernel_choice.py"], readers
    assert not old, old


def test_one_writer_of_the_measured_choices():
    """The GEMM plan and the quantized crossovers are cached by one writer (plan_cache):
    no other module of kvserve/layers writes JSON."""
    writers = sorted(p.name for p in (PACKAGE / "layers").glob("*.py")
                     if "json.dump" in p.read_text(encoding="utf-8"))
    assert writers == ["plan_cache.py"], writers
    for name in ("gemm_select.py", "kernel_choice.py"):
        assert "plan_cache" in _names_in(ast.parse((PACKAGE / "layers" / name).read_text()))


def test_quantized_apply_measures_nothing():
    """The quantized methods run the choice they were made with: no apply (nor anything it
    calls in quant_linear) reaches the measurement or the choice; making the method does."""
    funcs = _functions(PACKAGE / "layers" / "quant_linear.py")
    choosing = {"kernel_choice", "made_choice", "choice_of", "measured", "choose"}
    applies = [f for f in funcs if f.split(".")[-1] in ("apply", "apply_add", "_dequant_path")]
    assert len(applies) >= 4, applies
    for name in applies:
        seen, todo = set(), [name]
        while todo:  # the module's own functions it calls, transitively
            f = todo.pop()
            if f in seen:
                continue
            seen.add(f)
            used = _names_in(funcs[f])
            assert not used & choosing, f"{name} reaches {used & choosing} via {f}"
            todo += [g for g in funcs if g.split(".")[-1] in used and g not in seen]
    for init in ("QuantizedLinear.__init__", "QuantizedGated.__init__"):
        assert "made_choice" in _names_in(funcs[init])
