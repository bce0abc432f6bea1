"""Per-family image rules of vision-language models (torch-free): how many placeholder tokens an
image becomes and, where the family needs them, the prompt's rotary positions. The model registry
names each family's processor module; `srt/multimodal/processor.py` is the shared glue."""
