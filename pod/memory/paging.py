"""Page arithmetic, one definition for the pool, the step plan, the policy and the engine's
capacity (the kernels keep their own: they import nothing from the serving layers)."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens: a partial page counts whole."""
    return -(-num_tokens // page_size)
