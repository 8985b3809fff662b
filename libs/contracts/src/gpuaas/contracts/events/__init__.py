"""Event types, one module per topic."""
