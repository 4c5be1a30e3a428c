"""Adapters between front ends and the engine: tokenizer, chat template, sampling parameters.

Installed as colibri_backend.adapters.
"""
