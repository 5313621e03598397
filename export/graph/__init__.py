"""Hugging Face model -> ONNX graph with the bundle's KV-cache inputs and outputs: shared
attention and rotary code, one file per model family, and the tracing driver."""
