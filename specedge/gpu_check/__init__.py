"""`specedge gpu-check`: the GPU path end to end, in one short run on a CUDA machine, with a
JSON report (docs/gpu.md#specedge-gpu-check). `check.py` is the command and its report;
`sampling.py` checks the kernels against the numpy reference; `backends.py` the device KV
cache, the device loop and the engines against the host; `comparison.py` says how an
engine is judged against 'ort-cpu'; `two_sample.py` is the two-sample test it shares with
the test suite, and `tiny_checkpoints.py` the tiny random-weight checkpoints it exports.
"""
