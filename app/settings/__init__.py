"""Settings and the windows that choose what runs.

The settings dialog and its pages (forms built from the engine's SamplingParams, remote
providers, the Models window) and the flow that saves, applies and restarts the engine.
"""
