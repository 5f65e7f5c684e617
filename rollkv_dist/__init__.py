"""rollkv distribution tooling: pin, patch, build, gates and reports for llama.cpp with rolling KV."""

__version__ = "0.1.0"
