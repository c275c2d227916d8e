"""`python -m pagoda.entrypoints.openai.api_server`, as in vLLM."""
