"""Inference machinery shared by the server and the evaluator: a KV cache and batched generation."""
