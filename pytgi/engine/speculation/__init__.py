"""Speculative decoding: n-gram drafts from a request's own tokens, and a draft model's."""
