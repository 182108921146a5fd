"""The quick main case as the 2026-12-03 page tabulates it: mean TPOT per (model, budget, engine)."""
import sys
import pandas as pd
from experiments import records
df = records.load(sys.argv[1])
df["engine"] = df["hardware"].map({"a100_pcie4_hf": "hf", "a100_pcie4_ideal": "ideal"})
own = df["k_source"].astype(str).str.startswith("SpecMoEOff's K=")
tuned = (df["system"] == "specmoeoff") & ~own
rows = []
for (m, b, e), g in df.groupby(["model", "budget", "engine"], sort=False):
    t = lambda sel: g[sel]["tpot_ms"].mean() if sel.any() else float("nan")
    spec = t(g["system"] == "specter")
    k3 = t((g["system"] == "specmoeoff") & own.loc[g.index])
    tu = t(tuned.loc[g.index])
    ktu = g[tuned.loc[g.index]]["k"].iloc[0] if tuned.loc[g.index].any() else None
    ksp = g[g["system"] == "specter"]["k"].iloc[0]
    rows.append({"model": m, "budget": b, "engine": e, "resident": t(g["system"] == "resident"),
                 "host_experts": t(g["system"] == "host_experts"), "Specter": spec,
                 "K*": int(ksp), "SpecMoEOff K=3": k3,
                 "tuned": tu, "tuned K": int(ktu) if ktu == ktu and ktu is not None else None,
                 "lead K=3": k3 / spec, "lead tuned": tu / spec,
                 "acceptance": g[g["system"] == "specter"]["acceptance_rate"].mean()})
out = pd.DataFrame(rows).sort_values(["model", "budget", "engine"])
def f(v):
    if isinstance(v, float):
        return "" if v != v else f"{v:.2f}"
    return "" if v is None else str(v)
print("| " + " | ".join(out.columns) + " |")
print("| " + " | ".join("---" for _ in out.columns) + " |")
for _, r in out.iterrows():
    print("| " + " | ".join(f(v) for v in r) + " |")
