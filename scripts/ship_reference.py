"""Ship a project-made model's build in the repository: `python scripts/ship_reference.py NAME`.

Trains NAME from today's recipe on this CPU (or takes the local build already cached), copies
the checkpoint as built (safetensors, tokenizer, config, specter_build.json) to
reference_models/NAME/ and marks it `origin: reference`. From then on every machine decodes
these weights (specter/models/zoo.py `reference_checkpoint`); remeasure the tables made on the
model (README, figures/reference, ARTIFACT.md) and commit the folder with them.
"""

from __future__ import annotations

import json
import shutil
import sys


def main(argv: list[str]) -> int:
    from specter.models import zoo

    if len(argv) != 1:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    name = argv[0]
    local = zoo.ensure_project_model(name, build="local")
    out = zoo.REFERENCE_DIR / name
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(local, tmp, ignore=shutil.ignore_patterns("*.lock", "specter_routing.json"))
    meta = tmp / "specter_build.json"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), origin="reference"), indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    zoo.verify_reference(out)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    sha = json.loads((out / "specter_build.json").read_text())["weights_sha256"]
    print(f"shipped {name} ({size:.1f} MiB) to {out}; weights {sha[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
