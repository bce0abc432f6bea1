"""Vision-language inputs: image sources and decoding (gateway side, no torch), the Hugging Face
processor glue (tokenizer-manager side) and the image-embedding cache (scheduler side)."""
