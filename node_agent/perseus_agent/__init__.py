"""Perseus node agent: applies per-GPU frequency plans, measures energy, exports metrics.

Top-level modules: ``main`` (entry point), ``exporter`` (the Prometheus metrics and the GPU
readings taken at scrape time), ``metrics_server`` (the ``/metrics`` and ``/healthz`` HTTP
server), ``errors``, ``log_limit``; the subpackages' docstrings say what each owns.
"""
