"""tessera: serve Mixture-of-Experts LLMs on H200 pools with per-phase precision."""

__version__ = "0.1.0"
API_GROUP = "tessera.dev"
API_VERSION = "v1alpha1"
