"""Models on local disk: ``local`` (build the embedded model, save and load HF directories),
``tokenizer`` (the embedded character tokenizer), ``gguf`` (GGUF -> HF conversion),
``warmstart`` (supervised warm start of the embedded model), ``checkpoint`` (trainer checkpoints).
"""
