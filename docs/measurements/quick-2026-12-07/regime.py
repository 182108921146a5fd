import sys
import pandas as pd
from experiments import records
df = records.load(sys.argv[1])
df["engine"] = df["hardware"].map({"a100_pcie4_hf": "hf", "a100_pcie4_ideal": "ideal"})
own = df["k_source"].astype(str).str.startswith("SpecMoEOff's K=")
df = df[~((df["system"] == "specmoeoff") & ~own)]  # SpecMoEOff at its own K
cases = [("small_deepseek", "high"), ("small_deepseek", "low"), ("small_qwen", "high"),
         ("small_qwen", "low"), ("small_phi", "high")]
for e in ("ideal", "hf"):
    print("engine", e)
    for m, b in cases:
        g = df[(df.model == m) & (df.budget == b) & (df.engine == e)]
        t = lambda s: g[g.system == s]["tpot_ms"].mean()
        sp = g[g.system == "specter"]
        print(f"  {m} {b}: specter {t('specter'):.1f} resident {t('resident'):.1f} x_res {t('specter')/t('resident'):.2f} "
              f"specmoeoff {t('specmoeoff'):.1f} lead {t('specmoeoff')/t('specter'):.2f} "
              f"lru {t('lru'):.1f} transformers {t('transformers'):.1f} hidden {sp['h2d_hidden_frac'].mean():.2f} "
              f"hit {sp['hit_rate'].mean():.3f} acc {sp['acceptance_rate'].mean():.3f}")
print(df[df.model == "small_qwen"]["model.weights_sha256"].dropna().unique()[:3] if "model.weights_sha256" in df else "")
print(df.groupby("model")["checkpoint"].first() if "checkpoint" in df else "")
