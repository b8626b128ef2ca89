"""Python imports this at start-up when `stallwatch run` has put this folder first on PYTHONPATH: it starts
the client (`stallwatch.client.bootstrap`), then runs the `sitecustomize` this one hides, if there is one."""

import importlib.machinery
import importlib.util
import os
import sys

try:
    from stallwatch.client import bootstrap

    bootstrap.start()
except Exception as error:  # never stop the command: it runs uninstrumented
    print(f"stallwatch: this process runs uninstrumented: {error!r}", file=sys.stderr)


def _run_hidden() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


_run_hidden()
