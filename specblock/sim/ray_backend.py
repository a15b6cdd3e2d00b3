"""Optional Ray backend for sweeps: the same per-config function, one Ray task per configuration.

Ray is an optional extra (``pip install 'specblock[ray]'``); nothing else imports it. Address
``local`` starts a throwaway local instance (what the test uses); anything else is passed to
``ray.init(address=...)``, e.g. ``ray://head:10001`` or ``auto``.
"""

from __future__ import annotations

from collections.abc import Iterator


def run_on_ray(address: str, items: list[tuple[int, str]]) -> Iterator[tuple[int, dict]]:
    """Yield ``(index, result)`` as tasks finish; ``items`` are (index, config JSON)."""
    try:
        import ray
    except ImportError:
        raise ImportError("--ray needs Ray: pip install 'specblock[ray]'") from None
    from specblock.sim.sweep import _run_json

    started = not ray.is_initialized()
    if started:
        ray.init(address=None if address == "local" else address, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    try:
        task = ray.remote(num_cpus=1)(_run_json)
        refs = {task.remote(js): i for i, js in items}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for r in ready:
                yield refs[r], ray.get(r)
    finally:
        if started:
            ray.shutdown()
