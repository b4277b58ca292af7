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


# ------------------------------------------------------------------------------------------
# Issue 65, item 4 (Seams): the server calls AsyncLLMEngine methods only; stat loggers get
# EngineStats snapshots; the scheduler's hooks are given at construction; only the scheduler
# (and the hooks it is built with) drives the KV manager. Read from the source, like the above.
# ------------------------------------------------------------------------------------------

def _trees(root: Path = PACKAGE):
    """(path relative to the repository, parsed module) of every .py file under `root`."""
    for path in sorted(root.rglob("*.py")):
        yield str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text(encoding="utf-8"))


def _chain(node: ast.AST) -> list[str]:
    """The names of an attribute chain, outermost first: `self.kv.pins.pin` -> [pin, pins, kv,
    self]."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names


# What the server must not reach through an AsyncLLMEngine: the LLMEngine below it and its
# parts, and `call`, which runs any function of the LLMEngine on the loop thread.
ENGINE_INSIDES = {"kv", "tiers", "scheduler", "runner", "executor", "call"}


def engine_reach_ins(tree: ast.AST, server: bool) -> list[tuple[int, str]]:
    """`<x>.engine.engine` anywhere; in the server also any attribute named in
    ENGINE_INSIDES (the server holds no KV manager, scheduler or worker of its own)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = _chain(node)
        if chain[:2] == ["engine", "engine"] or server and node.attr in ENGINE_INSIDES:
            found.append((node.lineno, ".".join(reversed(chain))))
    return found


def test_the_reach_in_finder_finds_one():
    code = ("core = self.engine.engine\n"
            "n = core.kv.block_size\n"
            "await serving.engine.call(lambda e: e.unpin(i))\n"
            "await serving.engine.unpin(i)\n")
    assert [line for line, _ in engine_reach_ins(ast.parse(code), server=False)] == [1]
    assert [line for line, _ in engine_reach_ins(ast.parse(code), server=True)] == [1, 2, 3]


def test_the_server_calls_async_engine_methods_only():
    """Nothing outside kvserve/engine/ reaches the LLMEngine through an AsyncLLMEngine
    (`engine.engine`), and the server names no part of the engine: it asks the
    AsyncLLMEngine's own methods (memory report, cache report, pins, stats, ...)."""
    bad = []
    for root in (PACKAGE, PACKAGE.parent / "benchmarks", PACKAGE.parent / "scripts"):
        for rel, tree in _trees(root) if root.exists() else ():
            if not rel.startswith("kvserve/engine/"):
                bad += [(rel, line, what) for line, what in engine_reach_ins(
                    tree, server=rel.startswith("kvserve/server/"))]
    assert not bad, f"reaches into the engine: {bad}"


def _stat_logger_classes():
    """(module, class) of every stat logger (a class with on_step and on_idle) outside the
    engine package."""
    for rel, tree in _trees():
        if rel.startswith("kvserve/engine/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
                if {"on_step", "on_idle"} <= set(methods):
                    yield rel, node.name, methods


def test_stat_loggers_get_a_snapshot_and_import_nothing_of_the_kv_cache():
    """A stat logger's on_step / on_idle take an `EngineStats` (made by the engine once per
    step), never the engine; and nothing its module imports, directly or not, is a module of
    kvserve.kv that holds state (a leaf, importing nothing of kvserve, may be shared)."""
    graph = import_graph()
    leaves = {mod for mod, deps in graph.items() if not deps}
    loggers = list(_stat_logger_classes())
    assert {name for _, name, _ in loggers} >= {"PrometheusStatLogger", "KVEventPublisher"}
    for rel, name, methods in loggers:
        for hook in ("on_step", "on_idle"):
            first = methods[hook].args.args[1]
            assert ast.unparse(first.annotation or ast.Constant(None)) == "EngineStats", \
                f"{rel}: {name}.{hook} takes {first.arg}, not an EngineStats"
        module = rel[:-3].replace("/", ".")
        leaked = sorted(d for d in _reachable(graph, module)
                        if d.startswith("kvserve.kv") and d not in leaves)
        assert not leaked, f"{module} reaches the KV cache: {leaked}"
    # the protocol the engine calls them by says the same
    protocol = ast.parse((PACKAGE / "engine" / "async_engine.py").read_text(encoding="utf-8"))
    [stat_logger] = [n for n in ast.walk(protocol)
                     if isinstance(n, ast.ClassDef) and n.name == "StatLogger"]
    for f in stat_logger.body:
        if isinstance(f, ast.FunctionDef) and f.name in ("on_step", "on_idle"):
            assert ast.unparse(f.args.args[1].annotation) == "EngineStats"


SCHEDULER_NAMES = {"scheduler", "sched"}
SCHEDULER_HOOKS = {"audit", "swap", "spec", "blend", "vocab_size", "kv", "config", "bounded"}


def scheduler_rewirings(tree: ast.AST) -> list[tuple[int, str]]:
    """Assignments to a scheduler's attributes from outside it (`engine.scheduler.spec = x`),
    and, inside a class named Scheduler, to its collaborators anywhere but __init__."""
    found = []

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, ast.Assign):
            return [t for target in node.targets
                    for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            return [node.target]
        return []

    for node in ast.walk(tree):
        for target in targets(node):
            chain = _chain(target) if isinstance(target, ast.Attribute) else []
            if len(chain) >= 2 and chain[1] in SCHEDULER_NAMES:
                found.append((node.lineno, ".".join(reversed(chain))))
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name == "Scheduler":
            for method in cls.body:
                if isinstance(method, ast.FunctionDef) and method.name != "__init__":
                    for node in ast.walk(method):
                        for target in targets(node):
                            chain = _chain(target) if isinstance(target, ast.Attribute) else []
                            if chain[-1:] == ["self"] and len(chain) == 2 \
                                    and chain[0] in SCHEDULER_HOOKS:
                                found.append((node.lineno, "self." + chain[0]))
    return found


def test_the_rewiring_finder_finds_one():
    code = ("self.scheduler.audit = a\n"
            "engine.scheduler.spec, x = s, 1\n"
            "self.scheduler.waiting.append(r)\n"
            "class Scheduler:\n"
            "    def __init__(self, hooks):\n"
            "        self.swap = hooks.swap\n"
            "    def later(self):\n"
            "        self.num_preemptions += 1\n"
            "        self.blend = None\n")
    assert [line for line, _ in scheduler_rewirings(ast.parse(code))] == [1, 2, 9]


def test_the_scheduler_hooks_are_given_at_construction():
    """Nothing assigns to a scheduler's attributes from outside it, and the scheduler sets its
    collaborators (audit, swap, speculator, blender, grammar width, KV manager) in its
    constructor only: they come in SchedulerHooks, so a scheduler is whole when built."""
    bad = [(rel, line, what) for rel, tree in _trees()
           for line, what in scheduler_rewirings(tree)]
    assert not bad, f"a scheduler rewired after construction: {bad}"


# The KV manager's calls that change it or its parts (pool, prefix index, pins, tiers, events);
# its reads (match, block_table, usage, ...) are anyone's.
KV_MUTATING = {"start_prefetch", "wait_for_prefetch", "unblock", "admit", "plan_swap_out",
               "allocate_blocks", "allocate_slots", "trim", "free", "reseat",
               "cache_full_blocks", "end_step", "reset_prefix_cache", "drain_events",
               "set_tenant_quota", "pin", "unpin", "save", "touch", "mark_idle", "share",
               "release", "evict", "insert", "drop", "retain", "clear", "close",
               "set_max_fraction"}
KV_NAMES = {"kv", "manager", "kv_manager"}
# Who may drive it: the KV package itself; the scheduler; the hooks the scheduler is built with
# and alone calls (hit audits, bounded caches, document reuse; swap lives in kvserve/kv/); and
# the simulator, which is its own scheduler of the same manager (docs/architecture.md).
KV_DRIVERS = ("kvserve/kv/", "kvserve/engine/scheduler.py", "kvserve/engine/audit.py",
              "kvserve/engine/bounded_kv.py", "kvserve/blend/", "kvserve/sim/")


def kv_mutations(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls of a mutating method on the KV manager or a part of it (`kv.free(r)`,
    `self.kv.pins.pin(...)`, `engine.kv.tiers.save(...)`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in KV_MUTATING:
            chain = _chain(node.func)
            if KV_NAMES & set(chain[1:]):
                found.append((node.lineno, ".".join(reversed(chain))))
    return found


def test_the_kv_mutation_finder_finds_one():
    code = ("plan = self.kv.end_step()\n"
            "kv.pins.pin(probe, n, owner)\n"
            "n = self.kv.block_size\n"
            "self.engine.kv.tiers.save(h, data)\n"
            "m = kv.match(seq)\n"
            "self.scheduler.end_step()\n")
    assert [line for line, _ in kv_mutations(ast.parse(code))] == [1, 2, 4]


def test_only_the_scheduler_drives_the_kv_manager():
    """The engine, the server, the worker and the rest change the KV cache through the
    scheduler (Scheduler.end_step, start_prefetch, pin, save_chunks, ...), so every change to
    what the cache holds has one owner that also knows the queues."""
    bad = [(rel, line, what) for rel, tree in _trees() if not rel.startswith(KV_DRIVERS)
           for line, what in kv_mutations(tree)]
    assert not bad, f"the KV manager driven from outside the scheduler: {bad}"
    # the finder sees the scheduler's own calls (it is not blind)
    scheduler = ast.parse((PACKAGE / "engine" / "scheduler.py").read_text(encoding="utf-8"))
    assert {"self.kv.admit", "self.kv.free", "self.kv.end_step"} \
        <= {what for _, what in kv_mutations(scheduler)}


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


# -- Issue 65, item 5: a top level that shows the layers ------------------------------------------

TOP_LEVEL_CAP = 8


def test_the_top_level_holds_only_the_public_api():
    """The modules at the top of kvserve/ are what a user imports (LLM, config, sampling,
    outputs) and the request; everything else lives in the package of its layer, so the
    directory listing reads as the architecture."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_CAP, f"{len(top)} modules at the top of kvserve/: {top}"
    assert {"__init__.py", "config.py", "sampling.py", "outputs.py"} <= set(top)


def test_utils_holds_only_leaves():
    """kvserve/utils/ is below everything: a module there that imports kvserve has a concept
    and belongs with it (the graph would otherwise grow an upward edge through utils/)."""
    graph = import_graph()
    utils = [m for m in graph if m.startswith("kvserve.utils.")]
    assert "kvserve.utils.dtypes" in utils and "kvserve.utils.features" in utils
    upward = {m: sorted(graph[m]) for m in utils if graph[m] - {"kvserve.utils"}}
    assert not upward, f"utils/ modules that import kvserve: {upward}"


def test_the_installed_package_imports_nothing_of_the_bench_lab():
    """benchmarks/lab/ (figures, harness, llama.cpp runners, the reference checkpoint) is not
    installed (pyproject's packages: kvserve* only), so nothing in kvserve/ may import it:
    `kvserve bench` must run from a wheel."""
    import tomllib

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["include"] == ["kvserve*"]
    lab = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            lab += [f"{path.relative_to(PACKAGE.parent)}: {n}" for n in names
                    if n.split(".")[0] == "benchmarks"]
    assert not lab, lab
    assert (PACKAGE.parent / "benchmarks" / "lab" / "figures.py").exists()


def test_console_scripts_name_callables():
    """pyproject's console scripts (`kvserve`) point at a module and function that exist, so a
    move of the CLI cannot leave the installed command pointing at nothing."""
    import importlib
    import tomllib

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    scripts = pyproject["project"]["scripts"]
    assert "kvserve" in scripts
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


# -- Issue 65, item 1: projections own their weights ------------------------------------------
# Where model parts are built, loaded and prepared. Outside its own class nothing assigns an
# attribute of a model part (no `setattr(layer, ...)`, no `layer.x = ...`): a projection takes
# a file's blocks, frees or replaces its weight through its own methods
# (kvserve/layers/projection.py), and a method keeps what it makes in itself.
MODEL_SIDE = ("models", "layers", "model_loader")
# The attribute stores on objects other than `self` that are left, none on a model part:
# the GEMM plan's own record (a measured plan's kernels and source) and the GGUF reader's
# tensor record (the checkpoint name it maps to).
ALLOWED_FOREIGN_STORES = {("layers/gemm_select.py", "plan.kernels"),
                          ("layers/gemm_select.py", "plan.source"),
                          ("model_loader/loader.py", "tensor.name")}


def foreign_stores(tree: ast.AST) -> list[str]:
    """Every `x.attr = ...` (also augmented, annotated and in tuples) and `setattr(x, ...)` /
    `delattr(x, ...)` whose object is not the enclosing method's `self` (or `cls`), as the
    source text of its target."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            found += [ast.unparse(t) for t in ast.walk(target)
                      if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)
                      and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "delattr") and node.args \
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
            found.append(ast.unparse(node.args[0]) + " (" + node.func.id + ")")
    return found


def test_foreign_store_finder_sees_each_form():
    code = ("layer.w = 1\nsetattr(model, 'x', None)\nself.ok = 1\na.b, c = 1, 2\n"
            "m.n += 1\nsetattr(self, 'ok', 2)\n")
    assert sorted(foreign_stores(ast.parse(code))) == ["a.b", "layer.w", "m.n",
                                                       "model (setattr)"]


def test_no_module_assigns_a_model_parts_attributes():
    found = {(str(p.relative_to(PACKAGE)), store)
             for package in MODEL_SIDE for p in (PACKAGE / package).rglob("*.py")
             for store in foreign_stores(ast.parse(p.read_text(encoding="utf-8")))}
    assert found <= ALLOWED_FOREIGN_STORES, sorted(found - ALLOWED_FOREIGN_STORES)


def test_the_loader_matches_no_pointers():
    """A checkpoint tensor's projection is named by the weight map (`Target.owner`), not
    found by comparing addresses."""
    users = [str(p.relative_to(PACKAGE)) for p in (PACKAGE / "model_loader").rglob("*.py")
             if "data_ptr" in p.read_text(encoding="utf-8")]
    assert not users, users


# -- Issue 65, item 3: architecture flags out of ModelConfig ----------------------------------
# ModelConfig's fields that every architecture shares, or that the engine, the planner and the
# attention backends read (sizes, heads, vocabulary, windows, RoPE, EOS, dtype, the attention
# scale's inputs and soft-cap, MLA's cache layout, MoE's experts for the planner).
SHARED_CONFIG_FIELDS = {
    "architecture", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps",
    "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
    "layer_windows", "torch_dtype", "eos_token_id", "mla", "moe", "attn_logit_softcapping",
    "query_pre_attn_scalar", "attention_multiplier", "rotary_dim", "family"}
# Per-architecture switches still read by the shared decoder. This list may only shrink: a
# family's own setting goes in its own dataclass (`ModelConfig.family`, as Granite's
# `GraniteSettings`) or its own layer's constructor arguments, not here.
ARCHITECTURE_FIELDS_LEFT = {
    "attention_bias", "o_proj_bias", "mlp_bias", "qk_norm", "qk_norm_per_head", "hidden_act",
    "pre_norms", "output_norms", "embed_scale", "final_logit_softcapping", "logits_scaling",
    "sliding_rope_theta", "rope_layers"}


def test_model_config_holds_no_new_architecture_flag():
    from dataclasses import fields

    from kvserve.models.config import ModelConfig

    names = {f.name for f in fields(ModelConfig)}
    assert names - SHARED_CONFIG_FIELDS == ARCHITECTURE_FIELDS_LEFT, (
        "added: " + str(sorted(names - SHARED_CONFIG_FIELDS - ARCHITECTURE_FIELDS_LEFT))
        + "; gone (take them off ARCHITECTURE_FIELDS_LEFT): "
        + str(sorted(ARCHITECTURE_FIELDS_LEFT - names)))
