"""The operator's Kubernetes I/O: the API client, the watch indexes and the Lease.

``kube`` is the one module that calls the API; ``cluster_index`` answers a job's reads from
kopf's indexes; ``leader_election`` keeps one leader. May import ``jobs`` (the ``JobIO``
protocol it implements) and ``workloads``; never ``policies``, ``webhook`` or the adapters.
"""
