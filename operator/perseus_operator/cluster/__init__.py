"""The operator's Kubernetes I/O: the API clients, the watch indexes and the Lease.

``kube`` is the one package that calls the API (``client`` for the event loop, ``lease_api``,
``blocking_clients`` for the Helm hooks and the webhook); ``cluster_index`` answers a job's
reads from kopf's indexes; ``leader_election`` keeps one leader. May import ``jobs`` (the
``JobIO`` protocol it implements) and ``workloads``; never ``policies``, ``webhook`` or the
adapters.
"""
