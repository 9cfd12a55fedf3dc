"""BERT model (Google/DLE architecture, HF parameter names) with optional Tempo layers,
its config, and checkpoint interop with Hugging Face and NVIDIA DLE files."""
