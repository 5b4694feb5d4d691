"""The model: Llama-family layers, their config, weights from GGUF or safetensors."""
