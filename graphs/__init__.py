"""The static cache, eager prefill with selection, and the compiled / CUDA-graph decode step."""
