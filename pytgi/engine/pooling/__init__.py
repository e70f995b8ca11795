"""pooling."""
