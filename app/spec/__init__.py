"""Speculation: sampling with per-position randomness and verification of proposals."""
