"""Speculative decoding: proposers, the verifier, and demo models that quote their prompt."""
