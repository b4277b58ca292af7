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
                 "kvserve.layers.quantize_at_load", "kvserve.layers.qgemm_select")


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
