"""Self-speculative decoding over one model instance and one KV cache."""
