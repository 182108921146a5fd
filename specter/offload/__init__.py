"""The offloading runtime: routed experts in host memory, copied to device slots on demand.

This package owns moving expert bytes and keeping time (`link`, `intervals`) and the cost
model of the modelled hardware (`costmodel`). Which experts to move and when is decided by
the residency and prefetch policies, not by the link.
"""
