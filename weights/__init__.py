"""What every process agrees on about weights: the base model (where it is, its fingerprint, its config, the
device it runs on), the peft LoRA format, the artifact format and its transfer, and adapter names.

The registry, the trainer and the sampler never import one another; what two of them share lives here, once.
Nothing here imports torch at module level, so the registry's admin commands stay light.
"""
