"""speculation."""
