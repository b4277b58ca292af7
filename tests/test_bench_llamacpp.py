"""benchmarks.lab.llamacpp against fake llama.cpp tools and a fake llama-cpp-python: the tools'
JSON lines are parsed into the figures the comparisons report, failures carry the tool's
stderr, and the worker's NLL equals torch's cross entropy on the same logits."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from benchmarks.lab import harness, llamacpp
from benchmarks.lab.llamacpp_worker import window_nll


def fake_tool(bins: Path, name: str, body: str) -> None:
    """An executable `name` in `bins` that runs `body` (Python, argv in `args`)."""
    path = bins / name
    path.write_text(f"#!{sys.executable}\nimport json, sys\nargs = sys.argv[1:]\n"
                    + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_llama_bench_reads_the_last_rows_rate_and_the_peak_rss(tmp_path):
    fake_tool(tmp_path, "llama-bench", """
        assert args[args.index("-m") + 1] == "m.gguf" and args[args.index("-t") + 1] == "3"
        assert args[args.index("-o") + 1] == "jsonl" and "-d" in args
        print("llama-bench: loading", file=sys.stderr)
        print(json.dumps({"avg_ts": 1.0}))
        print(json.dumps({"avg_ts": 12.5, "n_gen": 16}))
    """)
    assert llamacpp.llama_bench(tmp_path, "m.gguf", 3, ["-d", "8"], 60) == 12.5
    rss: list[float] = []
    assert llamacpp.llama_bench(tmp_path, "m.gguf", 3, ["-d", "8"], 60, rss) == 12.5
    assert len(rss) == 1 and rss[0] > 1  # a Python process holds more than 1 MB


def test_batched_bench_output_rate_is_sequences_times_tokens_over_total_time(tmp_path):
    fake_tool(tmp_path, "llama-batched-bench", """
        get = lambda flag: int(args[args.index(flag) + 1])
        assert get("-c") == get("-npl") * (get("-npp") + get("-ntg")) + 64
        print(json.dumps({"pp": get("-npp"), "tg": get("-ntg"), "pl": get("-npl"), "t": 2.0}))
    """)
    assert llamacpp.batched_bench(tmp_path, "m.gguf", 2, 16, 32, 4, 60) == 4 * 32 / 2.0


def test_a_failed_tool_raises_with_its_stderr(tmp_path):
    fake_tool(tmp_path, "llama-bench", """
        print("error: unknown model architecture", file=sys.stderr)
        sys.exit(1)
    """)
    with pytest.raises(RuntimeError, match="unknown model architecture"):
        llamacpp.llama_bench(tmp_path, "m.gguf", 2, [], 60)


def test_window_nll_equals_torch_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=gen, dtype=torch.float64) * 4
    window = torch.randint(0, 50, (8,), generator=gen).tolist()
    nll, top1 = window_nll(logits.tolist(), window)
    ref = torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum")
    assert nll == pytest.approx(float(ref), rel=1e-12)
    assert top1 == logits.argmax(-1).tolist()


FAKE_LLAMA_CPP = '''
__version__ = "0.0-fake"
llama_model_default_params = None


class Llama:
    def __init__(self, model_path, **kw):
        self.scores = [[0.0, 1.0, 2.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]

    def generate(self, tokens, **kw):
        i = 0
        while True:
            yield (sum(tokens) + i) % 97
            i += 1

    def reset(self):
        pass

    def eval(self, tokens):
        pass

    def tokenize(self, text, add_bos, special):
        return list(text)
'''


@pytest.fixture
def fake_python_env(tmp_path) -> dict[str, str]:
    """llama-cpp-python's environment with a fake `llama_cpp` package on its path."""
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    return llamacpp.python_env(tmp_path, 1)


def test_the_generate_worker_reports_the_peers_greedy_tokens(tmp_path, fake_python_env):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"gguf": "m.gguf", "prompt": [5, 6, 7], "output_len": 4}))
    out = harness.run_json(llamacpp.worker_cmd(sys.executable, "generate", job, 1), 60,
                           fake_python_env)
    assert out["first_outputs"] == [[18, 19, 20, 21]], out
    assert out["version"] == "0.0-fake" and out["decode_tok_s"] > 0


def test_the_nll_worker_scores_each_window_and_tokenizes_the_texts(tmp_path, fake_python_env):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"gguf": "m.gguf", "context": 4, "windows": [[0, 2, 0, 2]],
                               "texts": ["ab"], "extra_bufts": True}))
    out = harness.run_json(llamacpp.worker_cmd(sys.executable, "nll", job, 1), 60,
                           fake_python_env)
    scores = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]], dtype=torch.float64)
    ref = torch.nn.functional.cross_entropy(scores, torch.tensor([2, 0, 2]), reduction="sum")
    assert out["nll"] == pytest.approx(float(ref)) and out["tokens"] == 3, out
    assert out["top1"] == [[2, 0, 2]] and out["tokenized"] == [[97, 98]]


def test_python_env_runs_the_sdist_on_its_build_or_on_another_librarys_build(tmp_path):
    env = llamacpp.python_env(tmp_path, 2)
    assert env["PYTHONPATH"] == str(tmp_path) and env["OMP_NUM_THREADS"] == "2"
    assert env["LLAMA_CPP_LIB_PATH"] == str(tmp_path / "build" / "bin")
    assert llamacpp.python_env(tmp_path, 2, "/x/avx2")["LLAMA_CPP_LIB_PATH"] == "/x/avx2"
