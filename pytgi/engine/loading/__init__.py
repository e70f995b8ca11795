"""A model's weights from a source (a GGUF file, a pre-quantized checkpoint, a safetensors directory)
through a quantization method into the kernels' layouts: `model.load_model`; this rank's paged model:
`rank.load_paged_model`."""
