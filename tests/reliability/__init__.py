"""Reliability suite: crashes, corruption, I/O errors, hostile input, soak (docs/reliability.md)."""
