"""The service's edges: each protocol (gRPC, OpenAI HTTP) translated to the engine's requests and back, and what
guards and watches them (security, tracing, metrics, connection limits). Nothing here decides what a step runs."""
