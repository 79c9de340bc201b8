"""The HTTP layer (FastAPI app, OpenAI schemas, SSE, metrics) on top of the dflash2 engine."""
