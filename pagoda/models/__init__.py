"""Model definitions, the architecture registry and weight loading."""
