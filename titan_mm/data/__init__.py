"""The data pipeline: sources, processors, packing, the resumable loader, built-in data sets and the tokenizer."""
