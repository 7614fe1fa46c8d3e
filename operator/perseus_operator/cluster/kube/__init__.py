"""The operator's only package that talks to the Kubernetes API (besides kopf itself).

``client`` is the event loop's async client (the jobs' and policies' reads and writes, and
:class:`~perseus_operator.cluster.kube.client.KubeError`); ``lease_api`` the leader election's
Lease; ``blocking_clients`` the Helm hooks' and the pod webhook's blocking clients. Every
other module of the operator asks them.
"""
