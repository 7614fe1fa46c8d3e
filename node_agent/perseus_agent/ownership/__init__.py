"""Which pod owns which GPU, and which pod a training connection comes from.

Owns the kubelet's PodResources client (``pod_resources``), the node's pods as the API server's
watch says they are now (``node_pods``: who an address or a pod UID is) and the binding of a
plan's assignments and of each connection to the pod as it is now (``gpu_ownership``). May import
``control``, ``serving`` and below; never ``plans`` or ``modes``.
"""
