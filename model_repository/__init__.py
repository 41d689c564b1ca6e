"""Triton model-repository templates rendered by `specbuild deploy`."""
