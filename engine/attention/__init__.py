"""Attention over the paged pool: the dispatch and the reference path (every backend), the
Metal and CUDA kernels (shaders/) and the launch plans they share.
"""
