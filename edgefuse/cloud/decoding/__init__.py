"""Decoding with the cloud LLM: the device's decoder loop, drafters, speculative decoding
(Leviathan et al., 2023) and logit fusion (Floe)."""
