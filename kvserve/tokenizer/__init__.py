"""Tokenizer code: tokenizer.py (Tokenizer over a Hugging Face tokenizer.json, chat templates,
incremental detokenization, stop strings) and train.py (the small byte-level BPE the tests and
make-model ship)."""
