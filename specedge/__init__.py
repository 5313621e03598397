"""specedge: exact speculative decoding for edge devices.

`specedge.export` (torch, transformers, onnx) turns a Hugging Face model into a bundle;
`specedge.runtime` (numpy, onnxruntime, tokenizers) runs it. The runtime never imports torch.
"""

__version__ = "0.1.0"
