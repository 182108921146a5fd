"""The offloading runtime: routed experts in host memory, copied to device slots on demand.

This package owns moving expert bytes (`store`, `cache`, `link`, `runtime`); the time those
moves and the compute take on the modelled hardware is the clock's (specter/clock/). Which
experts to move and when is decided by the residency and prefetch policies, not by the link.
"""
