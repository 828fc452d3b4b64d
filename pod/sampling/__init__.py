"""Sampling: parameters, logits processing and the draw, logprobs, grammars, and the exact
verification of a speculative draft."""
