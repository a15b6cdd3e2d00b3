"""Static shapes and compiled forwards for the hot path (opt-in: ``--compile``).

A room above ``runtime``: it imports ``runtime`` and ``policies``; ``runtime`` reaches it only
through the CLI's lazy ``--compile`` hook (``runtime.cli``), never at import time.
"""
