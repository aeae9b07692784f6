"""The four techniques, each usable on its own: sparsity, precision, microbatch, checkpointing."""
