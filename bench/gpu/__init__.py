"""The CUDA host's one call (``python -m bench.gpu``): the CUDA-marked tests, ``kvpool serve
--device cuda`` against transformers, the decode step beside its floor (``cli`` says how)."""
