"""Where every tensor of a model lives: on the device, in the host store, or nowhere.

One package decides it and carries it out, for every system:
- plan.py: the placement plan, made once per job before any weight loads, from what the system
  needs (a resident or load-whole system: everything on the device; one that offloads: its
  routed experts in the host store; a second instance drafting with INT4 experts: its routed
  experts nowhere) and the checkpoint's tensor names;
- loader.py: the one loader that carries a plan out, tensor by tensor from the safetensors
  files (or, for random weights, made in place), and records what went where;
- bytes.py: what a plan needs in each memory, from the safetensors headers alone, and the
  one-sentence refusals when a memory cannot hold it.

Imports: models/ (architectures, introspection, checkpoint folders) and offload/ (the host
store it fills); neither imports this package, nor each other.
"""
