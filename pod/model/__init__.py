"""The model: loading (GGUF, Hugging Face directories, synthetic), its layers and linears, the
tokenizer and chat template."""
