"""The engine's core: requests and sequences, the block manager, the scheduler (with ``update_from_output``), the
output processor, the decoding handlers (sampling, beam search, speculation) and EngineCore, which steps them."""
