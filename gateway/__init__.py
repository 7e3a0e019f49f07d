"""The HTTP gateway: the OpenAI-compatible API, the admin console, auth, metrics and the CLI."""
