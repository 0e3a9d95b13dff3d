"""Getting a model: resolving a spec (the embedded default, a folder, a Hugging Face repo),
loading a folder, converting the default GGUF, and the chat template.
"""
