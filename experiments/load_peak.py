"""Load time and peak memory of one checkpoint folder, each way the loader can place the
routed experts, each in a fresh process (so one's peak is not the other's):

- `whole`: the loader puts everything on the device (the placement plan of the resident
  system and the transformers baseline), then the host store copies the experts out of the
  fused parameters layer by layer (how offloading systems loaded before placement/loader.py);
- `host`: the experts read from the safetensors files straight into the host store, the
  device receiving only the non-expert weights.

Reports, per way: seconds to a ready offloaded model (load and host store), the process's
peak resident memory, and the device bytes (the CUDA allocator's peak on a GPU, otherwise
the bytes placed on the device tensor by tensor).

    python -m experiments.load_peak FOLDER [--dtype float32] [--device cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _measure(folder: str, dtype: str, device: str, way: str) -> dict:
    import resource

    import torch

    from specter.config import ModelConfig
    from specter.placement.loader import load_model
    from specter.placement.plan import PlacementPlan, plan_for
    from specter.offload.store import HostExpertStore, host_store

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    cfg = ModelConfig(name="folder", source="hf", path=folder, dtype=dtype)
    plan = PlacementPlan("device") if way == "whole" else plan_for(True, "host", dev)
    lm = load_model(cfg, dev, progress=False, plan=plan)
    if way == "whole":
        placed = sum(p.numel() * p.element_size() for p in lm.model.parameters())
        HostExpertStore.from_model(lm.model, pin=dev.type == "cuda")
    else:
        placed = lm.placed.device_bytes
        host_store(lm.model).adopt(lm.model)
    seconds = time.perf_counter() - t0
    return {"way": way, "ready_s": round(seconds, 2),
            "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "device_bytes": (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
                             else placed),
            "device_source": "cuda_allocator" if dev.type == "cuda" else "placed_tensors"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--one", choices=["whole", "host"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(_measure(args.folder, args.dtype, args.device, args.one)))
        return 0
    rows = []
    for way in ("whole", "host"):
        out = subprocess.run([sys.executable, "-m", "experiments.load_peak", args.folder,
                              "--dtype", args.dtype, "--device", args.device, "--one", way],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{way:6s} ready in {r['ready_s']:7.2f} s, peak host {r['peak_host_bytes'] / 2**30:6.2f}"
              f" GiB, device {r['device_bytes'] / 2**30:6.2f} GiB ({r['device_source']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
