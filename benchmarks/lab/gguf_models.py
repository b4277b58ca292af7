"""GGUF files of the sizes CPU users run, made locally: random-weight checkpoints of the
Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B and Qwen2.5-1.5B shapes (`kvserve make-model`'s
sizes of those names, bf16, sharded), converted by llama.cpp's own `convert_hf_to_gguf.py`
and quantized by its `llama-quantize` to each type asked for. Cached between runs under
$KVSERVE_CACHE_DIR/gguf-models/<shape>/<TYPE>.gguf; the checkpoint and the bf16 GGUF are
kept only with --keep (an 8B's are 16 GB each).

The tokenizer is the embedded SmolLM2's (49,152 tokens, a pre-tokenizer llama.cpp knows), so
every file shares one vocabulary: the Llama shapes take its size, the Qwen shape keeps its
151,936 rows (the converter pads the vocabulary with [PAD] tokens), as the balance between
the LM head and the layers is part of what a Qwen file measures.

The peer comparisons with llama.cpp in benchmarks/ call `ensure`. Needs a llama.cpp build
(benchmarks/bench_quant_llamacpp.py's set-up: the llama-cpp-python 0.3.36
sdist's vendored tree, built with `--target llama-quantize ...`) and `sentencepiece`
importable (the converter imports it).

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.lab.gguf_models \\
        --llama-src /tmp/llsrc/llama_cpp_python-0.3.36 --shapes llama-3.2-1b \\
        --types Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvserve.utils.paths import cache_dir

SHAPES = {  # make-model size -> (architecture, vocabulary override)
    "llama-3.2-1b": ("llama", 49152),
    "llama-3.2-3b": ("llama", 49152),
    "llama-3.1-8b": ("llama", 49152),
    "qwen2.5-1.5b": ("qwen2", None),
}
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0")


def llama_tree(src: Path) -> Path:
    """The llama.cpp source tree inside a llama-cpp-python sdist, or the tree itself."""
    return src / "vendor" / "llama.cpp" if (src / "vendor" / "llama.cpp").is_dir() else src


def make_checkpoint(shape: str, out: Path) -> None:
    """The random bf16 checkpoint with SmolLM2's tokenizer files beside it."""
    from kvserve.model_loader.default import embedded_model_path
    from kvserve.model_loader.gguf_checkpoint import tokenizer_dir
    from kvserve.model_loader.make_model import make_model

    arch, vocab = SHAPES[shape]
    tok = tokenizer_dir(embedded_model_path())
    ids = json.loads((tok / "config.json").read_text())
    overrides = {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"]}
    if vocab is not None:
        overrides["vocab_size"] = vocab
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_model(tmp, arch, shape, seed=0, dtype="bfloat16", with_tokenizer=False,
               overrides=overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, tmp / name)
    tmp.rename(out)


def convert(tree: Path, model_dir: Path, gguf: Path, outtype: str = "bf16",
            pre: str | None = None) -> None:
    """llama.cpp's convert_hf_to_gguf.py, in this interpreter (it needs torch, numpy,
    sentencepiece) with the tree's own gguf-py first on the path. `pre`: the pre-tokenizer to
    declare where llama.cpp does not recognise the checkpoint's (a locally made BPE; harmless
    where a benchmark feeds token ids, so the pre-tokenizer never runs)."""
    patch = ("import conversion.base as base\n"
             f"base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}\n"
             if pre else "")
    shim = ("import runpy, sys\n"
            f"root = {str(tree)!r}\n"
            "sys.path[:0] = [root, root + '/gguf-py']\n" + patch +
            "sys.argv = [root + '/convert_hf_to_gguf.py'] + sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    tmp = gguf.with_suffix(".tmp")
    subprocess.run([sys.executable, "-c", shim, str(model_dir), "--outtype", outtype,
                    "--outfile", str(tmp)], check=True, stdout=subprocess.DEVNULL)
    tmp.rename(gguf)


def quantize(tree: Path, src: Path, out: Path, kind: str) -> None:
    tmp = out.with_suffix(".tmp")
    subprocess.run([str(tree / "build" / "bin" / "llama-quantize"), str(src), str(tmp), kind],
                   check=True, capture_output=True)
    tmp.rename(out)


def ensure(src: Path, shape: str, types: list[str], keep: bool = False,
           root: Path | None = None) -> dict[str, Path]:
    """The files of `shape` in `types` (made if missing): type -> path."""
    tree = llama_tree(src)
    base = (root or cache_dir() / "gguf-models") / shape
    base.mkdir(parents=True, exist_ok=True)
    files = {t: base / f"{t}.gguf" for t in types}
    missing = [t for t, p in files.items() if not p.is_file()]
    if not missing:
        return files
    hf, bf16 = base / "hf", base / "BF16.gguf"
    if not bf16.is_file():
        if not (hf / "config.json").is_file():
            t0 = time.perf_counter()
            make_checkpoint(shape, hf)
            print(f"  {shape}: checkpoint in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        t0 = time.perf_counter()
        convert(tree, hf, bf16)
        print(f"  {shape}: BF16.gguf in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    for t in missing:
        t0 = time.perf_counter()
        quantize(tree, bf16, files[t], t)
        print(f"  {shape}: {t}.gguf ({files[t].stat().st_size / 1e6:.0f} MB) in "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if not keep:
        shutil.rmtree(hf, ignore_errors=True)
        bf16.unlink(missing_ok=True)
    return files


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-src", type=Path, required=True,
                   help="llama-cpp-python sdist dir or llama.cpp tree, built (build/bin)")
    p.add_argument("--shapes", default="llama-3.2-1b", help=f"comma list of {list(SHAPES)}")
    p.add_argument("--types", default=",".join(TYPES), help="comma list of llama-quantize types")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and the BF16 GGUF")
    args = p.parse_args()
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            p.error(f"unknown shape {shape!r}; one of {list(SHAPES)}")
        for kind, path in ensure(args.llama_src, shape, args.types.split(","), args.keep).items():
            print(f"{shape} {kind} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
