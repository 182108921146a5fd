"""The virtual clock, in a room of its own: what the modelled hardware would take.

`timing` (which clock a run keeps, its link and cost model), `observer` (the forwards' compute,
charged as it happens), `costmodel` (each step's seconds on a profile), `counted` (a profile
fitted from what a step launches and waits on), `calibration` (profiles checked against
publications), `intervals` (the link's busy and exposed time). The runtime that moves bytes
(specter/offload/) reports to it; nothing here moves a byte.
"""
