"""Attacks on what leaves the device: inversion of KV caches, hidden states, top-k logits and
token ids, and the privacy probe that scores them per protection mode."""
