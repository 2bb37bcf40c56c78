"""Speculative decoding: proposers (draft model, n-gram), lossless verification, the SD step."""
