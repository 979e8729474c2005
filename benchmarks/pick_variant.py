"""Print the environment assignments of the first model variant check_multi_gpu.py found working
(default kernels preferred), for a shell to export: ``export $(python3 benchmarks/pick_variant.py FILE)``."""
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from check_multi_gpu import MODEL  # noqa: E402

rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows[r["case"]] = r
for name in ("model_default", "model_no_pallas_sinkhorn", "model_no_pallas_moe", "model_xla"):
    if rows.get(name, {}).get("ok"):
        print(" ".join(f"{k}={v}" for k, v in MODEL[name].items()) or "DSV41_VARIANT=default")
        break
else:
    print("DSV41_KERNELS=xla")
