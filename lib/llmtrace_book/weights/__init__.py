"""Loaders: each returns (config, state dict in Hugging Face naming, tokenizer)."""
