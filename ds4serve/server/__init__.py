"""The HTTP server: OpenAI and Anthropic APIs over the engine (see docs/API.md)."""
