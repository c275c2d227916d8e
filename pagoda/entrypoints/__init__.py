"""Entry points kept at vLLM's module paths, for the habits of vLLM users."""
