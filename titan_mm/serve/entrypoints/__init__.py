"""What clients talk to: the OpenAI-compatible server (server, openai_protocol, async_engine, metrics) and the
``python -m titan_mm.serve`` command line (cli)."""
