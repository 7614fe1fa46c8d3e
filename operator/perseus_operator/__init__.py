"""The Perseus operator: PerseusJob lifecycle, planning and straggler handling.

Layers: pure logic (workload resolution, straggler detection, planning and the builders of
the objects to write) is unit-tested without Kubernetes; one package (``cluster.kube``) talks
to the API; kopf handlers are thin adapters over those.
"""
