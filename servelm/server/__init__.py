"""The OpenAI-compatible HTTP server: protocol schemas, routes, metrics, `servelm serve`."""
