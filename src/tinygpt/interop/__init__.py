"""Moving models between tinygpt and other formats: Hugging Face GPT-2 folders (hf_gpt2) and their
tokenizer files (hf_tokenizer), llama.cpp's GGUF (gguf), and low-precision weights for inference
(quantize). Workflows on top of the core; the model never imports them, and tinygpt.checkpoint
opens Hugging Face folders through them."""
