"""Tooling of vllm-hopper-decode: pin, fetch, import, apply, export, lint, wheel, index."""
