"""Converter benchmark: synthetic release-format checkpoints of several sizes -> Orbax, measured
with ``/usr/bin/time -v`` (wall time, peak RSS of the converter process).

    python benchmarks/bench_convert.py [--sizes 2.2,9.0] [--budgets 1GB,2GB] [--workdir /tmp/convbench]
        [--extra-args "--experts int8"] [--warm] [--out benchmarks/results/convert_<date>.json]

For each size (10^9 bytes of shards) ``make_synthetic_checkpoint.py`` writes a checkpoint (same
shapes, only the number of routed experts changes), then for each ``--max-memory`` budget

    /usr/bin/time -v python -m convert SRC DST --max-memory BUDGET --no-progress --report R

runs with a cold page cache for the source (``fsync`` + ``posix_fadvise(DONTNEED)`` on every shard;
``--warm`` skips that). Reported: source bytes, output bytes (``du``), wall seconds, source MB/s
(source bytes / wall), output MB/s, peak RSS, CPU %, and the converter's own split (NaN scan vs
writing). Every output is deleted after its run and every source after its size: the disk never
holds more than one source and one output.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def du_bytes(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for fn in files:
            try:
                total += os.lstat(os.path.join(d, fn)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def apparent_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def drop_from_cache(path: str) -> None:
    """Evict the files under ``path`` from the page cache (clean pages only: fsync first)."""
    for d, _, files in os.walk(path):
        for fn in files:
            fd = os.open(os.path.join(d, fn), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def parse_time_v(text: str) -> dict:
    def grab(label):
        m = re.search(re.escape(label) + r":\s*(.+)", text)
        return m.group(1).strip() if m else None

    wall = grab("Elapsed (wall clock) time (h:mm:ss or m:ss)")
    secs = 0.0
    for part in wall.split(":"):
        secs = secs * 60 + float(part)
    return {"wall_s": secs, "max_rss_kb": int(grab("Maximum resident set size (kbytes)")),
            "user_s": float(grab("User time (seconds)")), "sys_s": float(grab("System time (seconds)")),
            "cpu_percent": grab("Percent of CPU this job got"),
            "major_faults": int(grab("Major (requiring I/O) page faults")),
            "fs_inputs": int(grab("File system inputs")), "fs_outputs": int(grab("File system outputs"))}


def run_convert(src: str, dst: str, budget: str, extra: list[str], workdir: str) -> dict:
    report = os.path.join(workdir, "report.json")
    cmd = ["/usr/bin/time", "-v", PY, "-m", "convert", src, dst, "--max-memory", budget, "--no-progress",
           "--report", report] + extra
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    sys.stdout.write(p.stdout)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"convert failed with status {p.returncode}")
    res = parse_time_v(p.stderr)
    with open(report) as f:
        rep = json.load(f)
    os.unlink(report)
    res.update({"command": " ".join(cmd[2:]).replace(PY, "python"), "budget": budget,
                "slab_bytes": rep["slab_bytes"], "converter_seconds": rep["seconds"],
                "write_seconds": rep["write_seconds"], "bytes_written": rep["bytes_written"],
                "converter_mb_per_s": rep["mb_per_s"]})
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2.2,9.0", help="source sizes in GB (10^9 bytes), comma separated")
    ap.add_argument("--budgets", default="1GB,2GB", help="--max-memory values, comma separated")
    ap.add_argument("--workdir", default="/tmp/convbench")
    ap.add_argument("--extra-args", default="", help="more converter options, e.g. '--experts int8'")
    ap.add_argument("--gen-args", default="", help="more make_synthetic_checkpoint.py options")
    ap.add_argument("--warm", action="store_true", help="leave the source in the page cache")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/convert_<time>.json)")
    args = ap.parse_args(argv)
    if not os.path.exists("/usr/bin/time"):
        raise SystemExit("/usr/bin/time is missing (apt-get install -y time)")
    os.makedirs(args.workdir, exist_ok=True)
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   f"convert_{datetime.datetime.now():%Y-%m-%d_%H%M%S}.json")
    extra = shlex.split(args.extra_args)
    machine = {"cpus": os.cpu_count(), "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
               "python": sys.version.split()[0]}
    results = {"machine": machine, "extra_args": extra, "cold_cache": not args.warm, "runs": []}
    for size in [float(s) for s in args.sizes.split(",")]:
        src = os.path.join(args.workdir, f"src_{size:g}GB")
        shutil.rmtree(src, ignore_errors=True)
        t0 = time.time()
        gen = subprocess.run([PY, os.path.join(ROOT, "benchmarks", "make_synthetic_checkpoint.py"), src,
                              "--target-gb", str(size)] + shlex.split(args.gen_args),
                             cwd=ROOT, capture_output=True, text=True, check=True)
        summary = json.loads(gen.stdout.strip().splitlines()[-1])
        src_bytes = apparent_bytes(src)
        print(f"source {src}: {src_bytes / 1e9:.2f} GB, {summary['experts']} experts/layer, "
              f"{summary['shards']} shards, written in {time.time() - t0:.0f}s", flush=True)
        try:
            for budget in args.budgets.split(","):
                dst = os.path.join(args.workdir, "out")
                shutil.rmtree(dst, ignore_errors=True)
                shutil.rmtree(dst + ".partial", ignore_errors=True)
                if not args.warm:
                    drop_from_cache(src)
                try:
                    r = run_convert(src, dst, budget, extra, args.workdir)
                    r["output_bytes"] = du_bytes(dst)
                finally:
                    shutil.rmtree(dst, ignore_errors=True)
                    shutil.rmtree(dst + ".partial", ignore_errors=True)
                r.update({"source_gb_target": size, "source_bytes": src_bytes, "experts": summary["experts"],
                          "source_summary": summary,
                          "source_mb_per_s": src_bytes / r["wall_s"] / 1e6,
                          "output_mb_per_s": r["output_bytes"] / r["wall_s"] / 1e6})
                results["runs"].append(r)
                print(f"  budget {budget}: source {src_bytes / 1e9:.2f} GB -> output {r['output_bytes'] / 1e9:.2f} GB, "
                      f"wall {r['wall_s']:.1f}s ({r['write_seconds']:.1f}s writing), "
                      f"{r['source_mb_per_s']:.1f} MB/s source, {r['output_mb_per_s']:.1f} MB/s output, "
                      f"peak RSS {r['max_rss_kb'] / 2**20:.2f} GiB, CPU {r['cpu_percent']}", flush=True)
                with open(out, "w") as f:
                    json.dump(results, f, indent=1)
        finally:
            shutil.rmtree(src, ignore_errors=True)
    print(f"results: {out}")
    print("| source | experts | output | --max-memory | wall | source MB/s | output MB/s | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['source_bytes'] / 1e9:.2f} GB | {r['experts']} | {r['output_bytes'] / 1e9:.1f} GB | {r['budget']} | "
              f"{r['wall_s']:.0f} s | {r['source_mb_per_s']:.0f} | {r['output_mb_per_s']:.0f} | "
              f"{r['max_rss_kb'] / 2**20:.2f} GiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
