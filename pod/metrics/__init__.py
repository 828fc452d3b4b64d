"""Prometheus metrics (kvpark's, vLLM's and llama-server's names), read under the engine's
lock."""
