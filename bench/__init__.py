"""`specedge bench`: speculative vs plain decoding side by side, plus the tools users would
pick instead (Hugging Face transformers, llama.cpp, onnxruntime-genai) when they are
installed."""
