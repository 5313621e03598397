"""Hugging Face model -> ONNX graph with the bundle's KV-cache inputs and outputs: shared
attention, rotary and projection code, the decoder skeleton (decoder.py) with one file per
model family for what differs, and the tracing driver."""
