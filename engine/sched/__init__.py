"""Continuous batching: which sequences run in the next step and on which slots, and how
many prompt tokens a step may take. Pure bookkeeping on the allocator: no MLX here.
"""
