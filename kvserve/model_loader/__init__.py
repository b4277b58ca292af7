"""Getting a model's weights into the model kvserve builds: `loader.py` (safetensors or GGUF,
the slices a tensor-parallel rank reads, dtype guidance), `gguf_checkpoint/` (llama.cpp's files
read directly), `quantize_at_load.py`, `weight_bytes.py` (what the weights take, for the
planner), `make_model.py` (`kvserve make-model`: checkpoints made locally) and `default.py`
(the embedded default model). The architectures themselves are in kvserve/models.
"""
