"""kvpark: a Kubernetes-native LLM server that parks KV instead of failing."""
