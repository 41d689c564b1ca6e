"""The ground floor: the vocabulary every layer shares. Torch-free, and it imports no other folder of the
project (`tests/test_layers.py` keeps it so): errors, constants, the client contract (`contract`) and its wire
format (`wire`), request shaping (`requests`), manifests, metric names (`metrics`), the stage types a backend
sees (`stage`), the TensorRT-LLM version table (`upstream_facts`) and the cache location (`paths`)."""
