"""The bench lab: what the peer comparisons in benchmarks/ and the figures pages (docs/figures/)
run on, kept out of the installed package (`kvserve bench` needs none of it). harness.py (a
worker process per measurement, engines alternating, disturbed runs re-run), reference.py (the
reference checkpoint), gguf_models.py (GGUF files made by llama.cpp's tools), llamacpp.py and
llamacpp_worker.py (llama.cpp's tools and llama-cpp-python, run and parsed), figures.py
(`python -m benchmarks.lab.figures`: docs/figures/ rendered from the result records that
kvserve.bench.record writes)."""
