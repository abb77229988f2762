"""The model a worker serves: its checkpoint directory (safetensors or GGUF), loaded and checked before hello."""
