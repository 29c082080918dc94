"""Rollout generation: engine, KV cache, sampling, speculative verification, CUDA graph profiles."""
