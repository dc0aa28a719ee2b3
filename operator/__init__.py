"""tessera.operator."""
