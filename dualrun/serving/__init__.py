"""Inference engines dualrun can start for a separate role when vLLM is not the right fit (CPU, tests)."""
