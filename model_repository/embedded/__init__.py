"""Templates of the embedded (pure-PyTorch engine) Triton model repository."""
