"""The OpenAI-compatible HTTP server: protocol models, routes, and the `serve` launcher."""
