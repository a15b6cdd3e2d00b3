"""An OpenAI-compatible HTTP server over the runtime's engine (imports point down into runtime/)."""
