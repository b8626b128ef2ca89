"""The folder `stallwatch run` puts first on PYTHONPATH, for its `sitecustomize`; a package so that the client's
wheel carries it."""
