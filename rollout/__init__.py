"""Lossless speculative rollout engine, drafters, acceptance, strategies, selector, CUDA graph pool, backends."""
