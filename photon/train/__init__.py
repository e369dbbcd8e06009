"""photon's own training script: `python -m photon.train prepare|fit|agree|all`.

It makes small real models without downloading anything: the corpus is the running Python's
standard library, the tokenizer a byte-level BPE trained on it, the models Qwen3 checkpoints that
photon (and transformers) load like any Hugging Face directory. See docs/training.md.
"""
