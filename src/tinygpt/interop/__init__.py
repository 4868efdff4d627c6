"""Moving models between tinygpt and other formats: Hugging Face GPT-2 folders (hf_gpt2), llama.cpp's
GGUF (gguf), and low-precision weights for inference (quantize). Workflows on top of the core; the
model never imports them."""
