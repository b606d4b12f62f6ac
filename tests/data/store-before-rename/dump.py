"""Print what the store made before the rename (by commit b3e1c2c's `core` package, real tiny-Llama
engines: two compares and one rescore) holds, as JSON, with whichever package the tree given has.
expected.json is this script's output under b3e1c2c: `python dump.py TREE STORE_HOME`."""

import json
import math
import os
import sys

tree = sys.argv[1]
sys.path[:0] = [tree]
os.environ["LOGPROB_PARITY_HOME"] = sys.argv[2]
try:
    from core.results.store import Store
except ImportError:
    from logprob_parity.results.store import Store


def clean(v):
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if hasattr(v, "tolist"):
        return clean(v.tolist())
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    return v


s = Store()
out = {"runs": {}, "rollouts": {}}
for rid in ("25e6e5bff22f4a779cb2", "d673dd453e76fdc5e8d3"):
    r = s.load(rid)
    df = r.to_pandas()
    out["runs"][rid] = {
        "summary": {k: clean(v) for k, v in r.summary.items()},
        "dtype": r.dtype,
        "rows": {c: clean(df[c].tolist()) for c in ("token_id", "token", "hf_logprob", "vllm_logprob", "delta", "kl_topk")},
    }
ro = s.load_rollout("de6711afdd520c830ebc")
df = ro.to_pandas()
# the columns the old code had (a newer package adds `band`, each token's band: results.bands)
cols = [c for c in df.columns if c != "band"]
out["rollouts"]["de6711afdd520c830ebc"] = {"dtype": ro.dtype, "rows": {c: clean(df[c].tolist()) for c in cols}}
print(json.dumps(out, sort_keys=True, indent=1))
