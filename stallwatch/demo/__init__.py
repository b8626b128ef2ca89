"""The demo: a hub, a real nginx spoke, an emulated training job and the agent, on one machine."""

if __name__ != "stallwatch.demo":  # one file, one module name
    raise ImportError(f"import stallwatch.demo, not {__name__}: one file, one module name")
