"""The target model's files, read without loading it: `info.py` (config.json, safetensors headers,
stored parameter counts) and `tokenizer.py` (what the tokenizer files say about token ids). Light side;
this file imports nothing."""
