"""Weights from hf://, s3:// and gs:// into a local folder: `tessera-runtime fetch URI DIR`.

`source` is the contract with the operator (URI parsing, where a URI is cached, the argv,
the exit codes) and imports nothing beyond the standard library; `download` does the work
(resumable, every file verified, progress in the log) with the clients of `hub` and `store`,
imported only when a fetch runs.
"""
