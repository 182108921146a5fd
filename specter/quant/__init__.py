"""INT4 self-draft: quantized routed experts, kernels, and the shared draft/target instance."""
