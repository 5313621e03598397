"""`specedge build`: a bundle's ONNX graphs -> TensorRT engines, on the device. Torch-free."""
