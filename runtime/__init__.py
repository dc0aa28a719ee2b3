"""tessera.runtime."""
