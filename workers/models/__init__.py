"""Models on local disk: ``local`` (build the embedded model, save and load HF directories),
``tokenizer`` (the embedded character tokenizer), ``gguf`` (GGUF -> HF conversion),
``warmstart`` (supervised warm start of the embedded model), ``checkpoint`` (trainer checkpoints),
the reward models (``reward_text``, ``reward_model``, ``reward_vllm``, trained by
``reward_train``).
"""
