"""The route groups: generation, the model and tokenizer endpoints, slots, the open ones."""
