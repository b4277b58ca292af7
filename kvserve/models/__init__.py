"""The architectures kvserve runs: one module per family, one table (`registry`), and the model
code they share: `decoder.py` (CausalLM, DecoderLayer), `config.py` (ModelConfig),
`deepseek_layers.py` and `deepseek_config.py` (DeepSeek's MLA and MoE layers and config).

Adding an architecture is one module here (its config adapter, model class and checkpoint
weight map, as a `base.Family`) and one line in `registry.ARCHITECTURES`; the loader, the
planner, make-model and the GGUF reader find it there.
"""
