"""Request bodies to `GenerationRequest`s: the field tables, the parsers, prompts, tools and
structured output, and what a client is told about a bad request."""
